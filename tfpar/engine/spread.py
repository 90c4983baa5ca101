"""Weights created where they will live: flat slices until the layout is known.

A strategy that splits weights (tensor parallelism, ZeRO stage 3) learns a
weight's final layout only once its model is built (the built-in tensor
plan traces the model to find MLP pairs). Until then, each trainable weight
(and each int8 kernel `model.quantize("int8")` makes) created in its scope
is a `SpreadVariable`: the initial value is drawn once,
exactly as on one device, flattened, zero-padded and cut into K equal
slices, slice k stored on the k-th device that will own the weight. No
device holds more than 1/K of any weight. When the model is prepared, the
strategy moves each weight to its final layout one at a time (a whole
weight in transit) and `release`s its slices.

Keras wraps the `SpreadVariable` in its own `keras.Variable` (the strategy's
variable creator returns it from `tf.Variable(...)`); reading it gives the
whole weight, so the model builds and can be traced before it is prepared.
"""

import contextlib
import itertools
import threading

import numpy as np
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat import keras_trainer

_disabled = threading.local()
_ids = itertools.count()


@contextlib.contextmanager
def creating_in_place():
  """Variables created inside are created as the strategy always did (used
  when a weight moves to its final layout)."""
  previous = getattr(_disabled, "on", False)
  _disabled.on = True
  try:
    yield
  finally:
    _disabled.on = previous


def should_spread(kwargs):
  """Whether a `tf.Variable(**kwargs)` in a spreading strategy's scope is a
  model weight to create spread: trainable or int8 (a kernel or table
  `quantize("int8")` made, frozen), synchronized on write, not placed by
  its caller and not created while moving weights."""
  if getattr(_disabled, "on", False):
    return False
  if kwargs.get("colocate_with") is not None:
    return False
  dtype = kwargs.get("dtype")
  int8 = dtype is not None and tf.as_dtype(dtype) == tf.int8
  if not kwargs.get("trainable", True) and not int8:
    return False
  synchronization = kwargs.get("synchronization")
  return synchronization in (None, tf.VariableSynchronization.AUTO,
                             tf.VariableSynchronization.ON_WRITE)


def initial_tensor(kwargs, device):
  """The initial value of a `tf.Variable(**kwargs)`, computed on `device`
  (drawn once, as the default creator would)."""
  value = kwargs["initial_value"]
  with tf.init_scope(), tf.device(device):
    if callable(value):
      value = value()
    return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))


def flat_pieces(value, count):
  """`value` flattened, zero-padded to a multiple of `count` and cut into
  `count` equal vectors."""
  flat = tf.reshape(value, [-1])
  size = max(1, -(-int(flat.shape[0]) // count))
  flat = tf.pad(flat, [[0, size * count - int(flat.shape[0])]])
  return tf.split(flat, count)


def fingerprint(pieces):
  """A digest of a whole value cut into `pieces` (`flat_pieces`): its sum
  and sum of squares, float64 NumPy. Workers that drew the same value
  get equal digests; different draws differ.

  Example:

  >>> fingerprint(flat_pieces(tf.constant([1.0, 2.0, 2.0]), 2)).tolist()
  [5.0, 9.0]
  """
  flat = tf.cast(tf.concat(pieces, 0), tf.float64)
  return np.array([tf.reduce_sum(flat).numpy(),
                   tf.reduce_sum(flat * flat).numpy()])


def _components(part):
  values = getattr(part, "values", None)
  return tuple(values) if values is not None else (part,)


class SpreadVariable:
  """A weight stored as flat slices until its strategy lays it out.

  Args:
    shape: the weight's full shape.
    dtype: its dtype.
    name: its name.
    parts: the slice variables, in order (each a vector of
      ceil(elements / len(parts)) elements; mirrored over the data replicas
      or one per device).
    creation: the keyword arguments of the `tf.Variable` call it stands
      for, without the initial value (to create it in its final place).
    strategy: the strategy that created it, if any: variables created
      `colocate_vars_with` it (an optimizer built before the model was
      prepared, as `keras.models.load_model` does) go on `heads`.
    heads: the devices of those variables, one per local replica.

  Example:

  >>> import tensorflow as tf
  >>> from tfpar.engine.spread import SpreadVariable, flat_pieces
  >>> value = tf.reshape(tf.range(6.0), (2, 3))
  >>> spread = SpreadVariable((2, 3), tf.float32, "w", [
  ...     tf.Variable(p) for p in flat_pieces(value, 4)], {})
  >>> spread.numpy().tolist()
  [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
  """

  def __init__(self, shape, dtype, name, parts, creation, strategy=None,
               heads=()):
    self._shape = tf.TensorShape(shape)
    self._dtype = tf.as_dtype(dtype)
    self._name = name
    self._parts = list(parts)
    self.creation = dict(creation)
    # What TF's colocate_vars_with and Keras's optimizer (`_var_key`) read.
    self._distribute_strategy = strategy
    self._devices = tuple(heads)
    self._unique_id = f"tfpar_spread_{next(_ids)}"
    self._indices = tuple(range(len(self._parts)))
    self._count = len(self._parts)
    self._gather = None

  def held_across_workers(self, indices, count, gather):
    """Marks `parts` as slices `indices` of `count`, the others held by
    other workers (a data-parallel replica's slices on its worker).

    Args:
      indices: the index among all slices of each of `parts`.
      count: how many slices the weight has over all workers.
      gather: `gather(parts)`, a collective every worker calls in the same
        order: the whole flat value (all `count` slices concatenated).
    """
    self._indices, self._count, self._gather = tuple(indices), count, gather

  # Across workers, a digest of the whole value each worker drew (and of
  # the last whole value assigned): every worker must hold slices of the
  # same weight (`fingerprint`).
  drawn = None

  shape = property(lambda self: self._shape)
  dtype = property(lambda self: self._dtype)
  name = property(lambda self: self._name)
  trainable = property(lambda self: self.creation.get("trainable", True))
  synchronization = property(lambda self: self.creation.get(
      "synchronization", tf.VariableSynchronization.AUTO))
  aggregation = property(lambda self: self.creation.get(
      "aggregation", tf.VariableAggregation.NONE))

  @property
  def parts(self):
    if not self._parts:
      raise ValueError(
          f"Weight {self._name!r} was moved to its final layout; this spread "
          f"copy of it was released. Read the model's variable instead.")
    return self._parts

  @property
  def device(self):
    return _components(self.parts[0])[0].device

  def components(self):
    """The per-device variables holding the slices."""
    return tuple(c for part in self.parts for c in _components(part))

  @property
  def indices(self):
    """The index among all the weight's slices of each of `parts`."""
    return self._indices

  @property
  def count(self):
    """How many slices the weight has (on every worker)."""
    return self._count

  def read_value(self):
    """The whole weight (the slices concatenated where this runs; across
    workers, gathered from every worker: a collective)."""
    if len(self.parts) < self._count:
      return self._read_across_workers()
    flat = tf.concat([tf.convert_to_tensor(p) for p in self.parts], 0)
    return tf.reshape(flat[:self._shape.num_elements()], self._shape)

  def _read_across_workers(self):
    if tf.executing_eagerly():  # Every worker reads it: a collective.
      flat = tf.constant(self._gather(self.parts))
      return tf.reshape(flat[:self._shape.num_elements()], self._shape)
    if keras_trainer.in_shape_inference():  # A graph that never runs.
      return tf.zeros(self._shape, self._dtype)
    raise ValueError(
        f"Weight {self._name!r} is created sliced over several workers "
        f"(tfpar.ZeRO(stage=3)) and its model is not prepared yet; a "
        f"tf.function can read it only once the model is built and its "
        f"strategy's scope exited. Read it eagerly, on every worker.")

  value = read_value

  def __tf_tensor__(self, dtype=None, name=None):
    return tf.convert_to_tensor(self.read_value(), dtype=dtype, name=name)

  def __getitem__(self, index):  # A layer slicing its weight (GPT-OSS).
    return self.read_value()[index]

  def numpy(self):
    return self.read_value().numpy()

  def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
    return np.asarray(self.numpy(), dtype=dtype)

  def assign(self, value, use_locking=None, name=None, read_value=True):
    del use_locking, name
    value = tf.convert_to_tensor(value, dtype=self._dtype)
    pieces = flat_pieces(value, self._count)
    for part, index in zip(self.parts, self._indices):
      part.assign(pieces[index])
    if self.drawn is not None:  # Not known inside a graph: not checked.
      self.drawn = fingerprint(pieces) if tf.executing_eagerly() else None
    return self.read_value() if read_value else None

  def release(self):
    """Drops the slices (the weight now lives in its final layout)."""
    self._parts = []

  def __repr__(self):
    return (f"<SpreadVariable {self._name} shape={tuple(self._shape)} "
            f"slices={len(self._parts)}>")


def nbytes(variable):
  """Bytes of a variable's whole value."""
  return variable.shape.num_elements() * tf.as_dtype(variable.dtype).size


def is_spread(variable):
  """Whether a Keras variable's storage is still a `SpreadVariable`."""
  return isinstance(keras_layers.storage(variable), SpreadVariable)
