"""Keras's weight API in whole weights for tensor-parallel models.

A split weight is held as shard variables, which take its place in its
layer's variable lists (so the optimizer updates the shards). Keras's
`get_weights()` / `set_weights()` read those lists, so they would list
shards: 30 arrays where one device has 19. `install` gives the model and
every layer holding shards a `get_weights` / `set_weights` that speak the
whole weights, in exactly the count, order and shapes one device has.
"""

import numpy as np

from tfpar._compat import keras_layers


def whole(variables):
  """`variables` with each group of shards replaced by its whole
  `ShardedWeight`, at the position of its first shard."""
  found = []
  for variable in variables:
    shard_of = getattr(variable, "_tfpar_shard_of", None)
    if shard_of is None:
      found.append(variable)
    elif shard_of[1] == 0:
      found.append(shard_of[0])
  return found


def _get_weights(layer):
  def get_weights():
    """The values of the layer's weights (split ones whole) as arrays."""
    return [np.asarray(w.numpy()) for w in whole(layer.weights)]
  return get_weights


def _set_weights(layer):
  def set_weights(weights):
    """Sets the layer's weights (split ones whole) from arrays."""
    targets = whole(layer.weights)
    if len(targets) != len(weights):
      raise ValueError(
          f"You called `set_weights(weights)` on layer '{layer.name}' with a "
          f"weight list of length {len(weights)}, but the layer was "
          f"expecting {len(targets)} weights.")
    for target, value in zip(targets, weights):
      if tuple(target.shape) != tuple(np.shape(value)):
        raise ValueError(
            f"Layer {layer.name} weight shape {tuple(target.shape)} is not "
            f"compatible with provided weight shape {np.shape(value)}.")
    for target, value in zip(targets, weights):
      target.assign(value)
  return set_weights


def install(model):
  """Makes `get_weights` / `set_weights` of `model` and of its layers that
  hold shards give and take whole weights.

  Args:
    model: a model whose layers were split (`shard_layers`).
  """
  for layer in keras_layers.flatten_layers(model, include_self=True):
    if any(hasattr(w, "_tfpar_shard_of") for w in layer.weights):
      object.__setattr__(layer, "get_weights", _get_weights(layer))
      object.__setattr__(layer, "set_weights", _set_weights(layer))
