"""Sharded weights: splitting a built layer's variables over the tensor axis
and saving them as whole logical tensors."""

import keras
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
  >>> from tfpar.tensor_parallel.variables import LogicalTensor
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


class ShardedWeight(LogicalTensor):
  """The logical (whole) view of one weight split over the `tensor` axis.

  Shard `k` is a Keras variable on the k-th device of every replica. Reading
  the whole weight (`numpy()`, `value`) concatenates the shards; `assign`
  splits a whole value into them. Layers compute with the shards directly.

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
  name = property(lambda self: self.layout.path.split("/")[-1])

  @property
  def value(self):
    """The whole weight as one tensor (a gather of the shards)."""
    return self._serialize_to_tensors()[VARIABLE_VALUE]

  def __repr__(self):
    return (f"<ShardedWeight path={self.path} shape={self.shape} "
            f"{self.layout.style} axis={self.axis} shards={len(self.shards)}>")


def _owners(layer):
  """{variable path: (owning layer, variable)} inside `layer`."""
  owners = {}
  for sub in keras_layers.flatten_layers(layer, include_self=True):
    for variable in keras_layers.own_variables(sub):
      owners[variable.path] = (sub, variable)
  return owners


def shard_layer(layer_layout, tensor_size, shard_scope):
  """Replaces the split variables of one layer by their shards.

  Args:
    layer_layout: the layer's `LayerLayout`.
    tensor_size: the size of the tensor axis.
    shard_scope: `shard_scope(k)` is a context in which new variables are
      placed on the k-th device of every replica.

  Returns:
    {variable path: ShardedWeight or the unsplit Keras variable}.
  """
  owners = _owners(layer_layout.layer)
  logical = {}
  for variable_layout in layer_layout.variables:
    owner, variable = owners[variable_layout.path]
    if variable_layout.axis is None:
      logical[variable.path] = variable
      continue
    pieces = tf.split(tf.convert_to_tensor(variable.value), tensor_size,
                      variable_layout.axis)
    _release_spread(variable)  # Its creation-time slices, once read.
    shards = []
    for index, piece in enumerate(pieces):
      with shard_scope(index):
        shard = keras.Variable(piece, dtype=variable.dtype,
                               trainable=variable.trainable,
                               name=f"{variable.name}_shard{index}")
      keras_layers.set_path(shard, f"{variable.path}_shard{index}")
      shards.append(shard)
    weight = ShardedWeight(variable_layout, shards)
    _replace(owner, variable, weight)
    logical[variable.path] = weight
  for owner in {owners[path][0] for path in logical}:
    install_logical_saving(owner)
  return logical


def _release_spread(variable):
  """Frees the creation-time slices of a weight now held as shards."""
  storage = keras_layers.storage(variable)
  if hasattr(storage, "release"):
    storage.release()


def record_logical_weight(owner, variable, weight):
  """Puts `weight` (a whole-weight view) where `variable` was in `owner`'s
  logical order, the order `tfpar.logical_weights` and saving follow."""
  order = getattr(owner, "_tfpar_logical_order", None)
  if order is None:
    order = keras_layers.own_variables(owner)
    object.__setattr__(owner, "_tfpar_logical_order", order)
  order[[i for i, v in enumerate(order) if v is variable][0]] = weight


def _replace(owner, variable, weight):
  """Puts `weight`'s shards where `variable` was in `owner`'s variable lists
  and `weight` where `variable` was among its attributes."""
  record_logical_weight(owner, variable, weight)
  for store in keras_layers.variable_lists(owner):
    for position, item in enumerate(store):
      if item is variable:
        store[position:position + 1] = list(weight.shards)
        break
  for attribute, value in list(vars(owner).items()):
    if value is variable:
      object.__setattr__(owner, attribute, weight)
      # tf.train.Checkpoint follows tracked attributes: save the whole
      # weight where the variable was (and let the variable go).
      keras_layers.track(owner, weight, attribute)


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
  result = {}
  for layer in keras_layers.flatten_layers(model, include_self=True):
    order = getattr(layer, "_tfpar_logical_order", None)
    items = order if order is not None else (
        keras_layers.own_variables(layer))
    for item in items:
      result[item.path] = np.asarray(item.numpy())
  return result


def logical_weights_paths(model):
  """(path, full shape) of every logical weight of `model`, in order."""
  for layer in keras_layers.flatten_layers(model, include_self=True):
    order = getattr(layer, "_tfpar_logical_order", None)
    items = order if order is not None else (
        keras_layers.own_variables(layer))
    for item in items:
      yield item.path, tuple(item.shape)
