"""Splitting a built layer's variables over the tensor axis (the whole
weights they stand for are in `tfpar.common.split_weights`)."""

import keras
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.common import piece_terms
from tfpar.common.split_weights import install_logical_saving
from tfpar.common.split_weights import record_logical_weight
from tfpar.common.split_weights import ShardedWeight


def owners_of(layer):
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
  owners = owners_of(layer_layout.layer)
  logical = {}
  for variable_layout in layer_layout.variables:
    owner, variable = owners[variable_layout.path]
    if variable_layout.axis is None:
      logical[variable.path] = variable
      continue
    piece_terms.check_splittable(variable, variable_layout.axis)
    pieces = tf.split(tf.convert_to_tensor(variable.value), tensor_size,
                      variable_layout.axis)
    release_spread(variable)  # Its creation-time slices, once read.
    shards = []
    for index, piece in enumerate(pieces):
      with shard_scope(index):
        shard = keras.Variable(piece, dtype=variable.dtype,
                               trainable=variable.trainable,
                               name=f"{variable.name}_shard{index}")
      keras_layers.set_path(shard, f"{variable.path}_shard{index}")
      shards.append(shard)
    piece_terms.carry_over(variable, shards)
    weight = ShardedWeight(variable_layout, shards)
    _replace(owner, variable, weight)
    logical[variable.path] = weight
  for owner in {owners[path][0] for path in logical}:
    install_logical_saving(owner)
  return logical


def release_spread(variable):
  """Frees the creation-time slices of a weight now held as shards."""
  storage = keras_layers.storage(variable)
  if hasattr(storage, "release"):
    storage.release()


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
