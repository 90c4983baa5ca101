"""Keras's weight API in whole weights for tensor- and expert-parallel
models.

A split weight is held as pieces, which take its place in its layer's
variable lists (so the optimizer updates the pieces): tensor shards, or
the local experts of an expert weight (one variable per tensor column
under expert x tensor). Keras's
`weights`, `get_weights()` / `set_weights()` and `count_params()` read
those lists, so they would list shards: 30 arrays where one device has 19.
`install` makes them speak whole weights, in exactly the count, order and
shapes one device has, on the model and on every layer holding shards:

- `weights` lists each split weight's whole view (`ShardedWeight`,
  `ExpertWeight`) at the position of its first piece, which reads,
  assigns and converts as a whole value;
- `trainable_weights` / `non_trainable_weights`, and `variables` /
  `trainable_variables` / `non_trainable_variables`, keep listing the
  variables held (shards, local experts), the ones the trainer and the
  optimizer use;
- the model's `summary` counts whole weights (under SPMD a split weight
  is one variable of the shard's shape).
"""

import numpy as np

from tfpar._compat import keras_layers
from tfpar._compat import keras_weights_view


def whole(variables, kinds=None):
  """`variables` with each group of pieces replaced by its whole weight,
  at the position of its first piece.

  Args:
    variables: a list of Keras variables, some of them pieces of a weight
      (tensor shards, local experts).
    kinds: None for every kind of piece, or a class: only pieces of whole
      weights of that class are replaced (the others stay as they are).

  Returns:
    The list, whole.

  Example:

  >>> import keras
  >>> from tfpar.common import whole_weights
  >>> layer = keras.layers.Dense(2, name="out")
  >>> layer.build((None, 3))
  >>> [v.path for v in whole_weights.whole(layer.weights)]
  ['out/kernel', 'out/bias']
  """
  found = []
  for variable in variables:
    shard_of = getattr(variable, "_tfpar_shard_of", None)
    if shard_of is None or (kinds is not None and
                            not isinstance(shard_of[0], kinds)):
      found.append(variable)
    elif shard_of[1] == 0:
      found.append(shard_of[0])
  return found


def held(layer):
  """The variables `layer` and its sub-layers hold, in Keras's `weights`
  order: tensor shards rather than whole weights.

  Args:
    layer: a Keras layer or model, sharded or not.

  Returns:
    A list of Keras variables (on an unsharded layer, `layer.weights`).

  Example:

  >>> import keras
  >>> from tfpar.common import whole_weights
  >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  >>> [tuple(v.shape) for v in whole_weights.held(model)]
  [(3, 2), (2,)]
  """
  return keras_weights_view.held_weights(layer)


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


def _summary(model):
  stock = model.summary

  def summary(*args, **kwargs):
    """Keras's summary, its parameter counts those of whole weights."""
    with keras_weights_view.listing_whole():
      return stock(*args, **kwargs)
  return summary


def install(model):
  """Makes Keras's weight API of `model` and of its layers that hold
  pieces of weights (tensor shards, local experts) give and take whole
  weights: `weights`, `get_weights` / `set_weights` and `count_params`,
  and the model's `summary`.

  Args:
    model: a model whose layers were split (`shard_layers`, experts).

  Example:

  The strategies call it once they split a model:

  >>> import keras, numpy as np, tfpar
  >>> from tfpar.common import whole_weights
  >>> strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 2}))
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((4,)),
  ...                             keras.layers.Dense(8, name="up"),
  ...                             keras.layers.Dense(4, name="down")])
  >>> _ = model.predict(np.ones((2, 4)), verbose=0)  # Split by now.
  >>> [w.numpy().shape for w in model.weights]
  [(4, 8), (8,), (8, 4), (4,)]
  >>> [tuple(v.shape) for v in whole_weights.held(model)]  # Shard shapes.
  [(4, 4), (4,), (4, 4), (4,)]
  >>> model.count_params()
  76
  """
  for layer in keras_layers.flatten_layers(model, include_self=True):
    variables = held(layer)
    if any(hasattr(w, "_tfpar_shard_of") for w in variables):
      object.__setattr__(layer, "get_weights", _get_weights(layer))
      object.__setattr__(layer, "set_weights", _set_weights(layer))
      keras_weights_view.show_weights_as(layer, whole)
  if hasattr(model, "summary") and not hasattr(model, "_tfpar_summary"):
    object.__setattr__(model, "_tfpar_summary", True)
    object.__setattr__(model, "summary", _summary(model))
