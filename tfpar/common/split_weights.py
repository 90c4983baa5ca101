"""Weights held in pieces on several devices (tensor shards, expert
groups), seen and saved as whole logical tensors.

Tensor and expert parallelism split weights; ZeRO slices them further.
All three, and checkpoints, read the pieces through what is here: a
`LogicalTensor` concatenates them for `tf.train.Checkpoint`, a layer's
logical order keeps whole weights where their variables were, and
`logical_entries` gives an optimizer's state as one device has it."""

import numpy as np
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat.tf_modules import trackable_base

# The checkpoint key of a variable's value; a whole logical tensor saved
# under it restores into an unsharded variable and back.
VARIABLE_VALUE = "VARIABLE_VALUE"


class LogicalTensor(trackable_base.Trackable):
  """A whole tensor kept as pieces split along `axis`, saved whole.

  Args:
    pieces: Keras variables holding the pieces, in order.
    axis: the axis they are split along.

  Example:

  >>> import keras
  >>> from tfpar.common.split_weights import LogicalTensor
  >>> whole = LogicalTensor([keras.Variable([[1.0], [2.0]]),
  ...                        keras.Variable([[3.0], [4.0]])], axis=1)
  >>> whole.numpy().tolist()
  [[1.0, 3.0], [2.0, 4.0]]
  """

  def __init__(self, pieces, axis):
    self._pieces = list(pieces)
    self._axis = axis

  def numpy(self):
    """The whole tensor as a NumPy array."""
    return np.concatenate([p.numpy() for p in self._pieces], self._axis)

  def assign(self, value):
    """Sets the whole tensor from a full-shape value."""
    value = np.asarray(value)
    for piece, part in zip(self._pieces,
                           np.split(value, len(self._pieces), self._axis)):
      if tuple(part.shape) != tuple(piece.shape):
        raise ValueError(
            f"Cannot assign a value of shape {tuple(value.shape)} to a "
            f"tensor split into {len(self._pieces)} pieces of shape "
            f"{tuple(piece.shape)} along axis {self._axis}.")
      piece.assign(part)

  # tf.train.Checkpoint: one entry holding the whole tensor.
  def _serialize_to_tensors(self):
    return {VARIABLE_VALUE: tf.concat(
        [tf.convert_to_tensor(p.value) for p in self._pieces], self._axis)}

  def _restore_from_tensors(self, restored_tensors):
    self.assign(restored_tensors[VARIABLE_VALUE])


class WholeWeightView:
  """What a whole view of a weight held in pieces (`ShardedWeight`, an
  expert weight) shares with a Keras variable, given its `path`, `shape`,
  `numpy()` and `value`: `name`, `ndim`, `np.asarray(weight)` and
  `tf.convert_to_tensor(weight)` (as Keras ops read a variable)."""

  name = property(lambda self: self.path.split("/")[-1])
  ndim = property(lambda self: len(self.shape))

  def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
    """`np.asarray(weight)`: the whole weight (a new array)."""
    return self.numpy() if dtype is None else self.numpy().astype(dtype)


def _as_tensor(value, dtype=None, name=None, as_ref=False):  # pylint: disable=unused-argument
  return value.value  # TensorFlow checks `dtype` against it, as for a tensor.


# `tf.convert_to_tensor(weight)` and Keras ops read a whole weight listed in
# `model.weights` as they read a variable.
tf.register_tensor_conversion_function(WholeWeightView, _as_tensor)


class ShardedWeight(WholeWeightView, LogicalTensor):
  """The logical (whole) view of one weight split over the `tensor` axis.

  Shard `k` is a Keras variable on the k-th device of every replica. Reading
  the whole weight (`numpy()`, `value`, `np.asarray`, `tf.convert_to_tensor`)
  concatenates the shards; `assign` splits a whole value into them. Layers
  compute with the shards directly. `model.weights` and `layer.weights` list
  it where its shards are held (`tfpar.common.whole_weights`).

  Args:
    layout: its `VariableLayout`.
    shards: the shard Keras variables, in tensor order.

  Example:

  >>> weight = model.get_layer("up")._kernel  # doctest: +SKIP
  >>> weight.numpy().shape, [s.shape for s in weight.shards]  # doctest: +SKIP
  ((8, 16), [(8, 8), (8, 8)])
  """

  def __init__(self, layout, shards):
    super().__init__(shards, layout.axis)
    self.layout = layout
    self.shards = tuple(shards)
    for index, shard in enumerate(self.shards):
      shard._tfpar_shard_of = (self, index)  # pylint: disable=protected-access

  path = property(lambda self: self.layout.path)
  shape = property(lambda self: tuple(self.layout.shape))
  axis = property(lambda self: self.layout.axis)
  dtype = property(lambda self: self.shards[0].dtype)
  trainable = property(lambda self: self.shards[0].trainable)

  @property
  def value(self):
    """The whole weight as one tensor (a gather of the shards)."""
    return self._serialize_to_tensors()[VARIABLE_VALUE]

  def __repr__(self):
    return (f"<ShardedWeight path={self.path} shape={self.shape} "
            f"{self.layout.style} axis={self.axis} shards={len(self.shards)}>")



def record_logical_weight(owner, variable, weight):
  """Puts `weight` (a whole-weight view) where `variable` was in `owner`'s
  logical order, the order `tfpar.logical_weights` and saving follow."""
  order = getattr(owner, "_tfpar_logical_order", None)
  if order is None:
    order = keras_layers.own_variables(owner)
    object.__setattr__(owner, "_tfpar_logical_order", order)
  order[[i for i, v in enumerate(order) if v is variable][0]] = weight


def install_logical_saving(owner):
  """`owner` saves and loads whole logical tensors, in its original order,
  so checkpoints load into any tensor size or no strategy at all."""
  if getattr(owner, "_tfpar_saves_logical", False):
    return

  def save_own_variables(store):
    for index, item in enumerate(owner._tfpar_logical_order):  # pylint: disable=protected-access
      store[str(index)] = np.asarray(item.numpy())

  def load_own_variables(store):
    order = owner._tfpar_logical_order  # pylint: disable=protected-access
    if len(store.keys()) != len(order):
      raise ValueError(
          f"Layer {owner.name!r} has {len(order)} logical weights but the "
          f"checkpoint lists {len(store.keys())} for it.")
    for index, item in enumerate(order):
      item.assign(store[str(index)])

  object.__setattr__(owner, "save_own_variables", save_own_variables)
  object.__setattr__(owner, "load_own_variables", load_own_variables)
  object.__setattr__(owner, "_tfpar_saves_logical", True)


def sharded_weights(model):
  """Every `ShardedWeight` of a sharded model, by logical path."""
  found = {}
  for layer in keras_layers.flatten_layers(model, include_self=True):
    for item in getattr(layer, "_tfpar_logical_order", ()):
      if isinstance(item, ShardedWeight):
        found[item.path] = item
  return found


def logical_weights(model):
  """{path: NumPy array} of every weight of `model`, sharded weights whole.

  The same dictionary an unsharded copy of the model gives, so results can
  be compared across layouts.

  Args:
    model: a Keras model, sharded by a `TensorParallelStrategy` or not.

  Example:

  >>> import keras, tfpar
  >>> model = keras.Sequential(
  ...     [keras.Input((2,)), keras.layers.Dense(3, name="out")], name="net")
  >>> sorted(tfpar.logical_weights(model))
  ['net/out/bias', 'net/out/kernel']
  """
  return {item.path: np.asarray(item.numpy()) for item in _logical_items(model)}


def logical_weights_paths(model):
  """(path, full shape) of every logical weight of `model`, in order."""
  for item in _logical_items(model):
    yield item.path, tuple(item.shape)


def _logical_items(model):
  """Every layer's weights in its logical order (split ones whole)."""
  for layer in keras_layers.flatten_layers(model, include_self=True):
    order = getattr(layer, "_tfpar_logical_order", None)
    yield from (order if order is not None else
                keras_layers.own_variables(layer))


def logical_entries(items, weights, slots=None):
  """`items` (optimizer variables, or the model variables it tracks) in the
  order an unsharded model's optimizer has them: the shards of a weight
  become the whole weight, the per-shard slots of a weight one whole slot.

  `slots` memoizes the whole slots, so lists that share a slot share its
  `LogicalTensor` (a checkpoint saves it once).
  """
  slots = {} if slots is None else slots
  prefixes = {}
  for weight in weights.values():
    for index, shard in enumerate(weight.shards):
      prefixes[shard.path.replace("/", "_") + "_"] = (weight, index)
  groups, entries = {}, []
  for item in items:
    shard_of = getattr(item, "_tfpar_shard_of", None)
    if shard_of is not None:
      if shard_of[1] == 0:
        entries.append(shard_of[0])
      continue
    name = getattr(item, "name", "")
    owner = next(((w, i, name[len(p):]) for p, (w, i) in prefixes.items()
                  if name.startswith(p)), None)
    if owner is None:
      entries.append(item)
      continue
    weight, index, slot_name = owner
    key = (weight.path, slot_name)
    if key not in groups:
      groups[key] = ([None] * len(weight.shards), weight.axis)
      entries.append(key)
    groups[key][0][index] = item
  for key, (pieces, axis) in groups.items():
    if key not in slots:
      slots[key] = LogicalTensor(pieces, axis)
  return [slots[e] if isinstance(e, tuple) else e for e in entries]
