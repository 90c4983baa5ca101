"""Spread weights laid out whole: a model's Keras variables whose storage is
still a `SpreadVariable` (`engine/spread.py`) given an ordinary variable of
the strategy, one weight at a time, for the weights a strategy does not
split (data parallelism, pipeline stages, the replicated weights of a
tensor-parallel plan)."""

import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.engine import spread


def pending_weights(model):
  """The Keras variables of `model` whose storage is still spread."""
  found, seen = [], set()
  for layer in keras_layers.flatten_layers(model, include_self=True):
    for variable in keras_layers.own_variables(layer):
      if id(variable) not in seen and spread.is_spread(variable):
        seen.add(id(variable))
        found.append(variable)
  return found


def materialize_pending(model, strategy, skip=frozenset()):
  """Lays out `model`'s weights still spread, but those in `skip` (paths),
  whole on every device (`materialize`), one at a time."""
  for variable in pending_weights(model):
    if variable.path not in skip:
      materialize(variable, strategy)


def _check_keras_storage(variable):
  if not keras_layers.can_replace_storage(variable):
    raise RuntimeError(
        f"tfpar expected a Keras variable with `_value` storage; "
        f"{type(variable).__name__} has none (a Keras upgrade changed it).")


def materialize(variable, strategy):
  """Gives a Keras variable whose storage is spread an ordinary variable of
  `strategy` (a copy per replica head), then releases the slices.

  Args:
    variable: a Keras variable with `SpreadVariable` storage.
    strategy: the strategy whose scope creates the new variable.
  """
  _check_keras_storage(variable)
  storage = keras_layers.storage(variable)
  whole = storage.read_value()
  storage.release()
  with strategy.scope(), spread.creating_in_place():
    kwargs = dict(storage.creation)
    kwargs["initial_value"] = whole
    replacement = tf.Variable(**kwargs)
  keras_layers.replace_storage(variable, replacement)
