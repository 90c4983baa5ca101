"""The parts of `keras.distribution` tfpar reads or replaces.

Keras keeps a `ModelParallel`'s layout map only in a private attribute;
`tfpar.from_keras_distribution` reads it to split the same weights on
TensorFlow. `keras.distribution.set_distribution` is a function of Keras's
private `distribution_lib` module, which `Distribution.scope()` looks up
there at each call; tfpar replaces it (in that module and in the public
`keras.distribution` namespace) to make the distribution's strategy
TensorFlow's default.
"""

import keras

from tfpar._compat.checks import require
from tfpar._compat.keras_modules import distribution_lib


def layout_map(distribution):
  """The `keras.distribution.LayoutMap` a `ModelParallel` was made with."""
  return require(distribution, "_layout_map", "the ModelParallel layout map")


def set_distribution_function():
  """The `set_distribution` Keras's `Distribution.scope()` calls."""
  return require(distribution_lib, "set_distribution",
                 "keras.distribution.set_distribution on TensorFlow")


def replace_set_distribution(function):
  """Makes `function` Keras's `set_distribution`: what
  `keras.distribution.set_distribution` and `Distribution.scope()` call."""
  set_distribution_function()  # Checked before anything changes.
  require(keras.distribution, "set_distribution",
          "keras.distribution.set_distribution on TensorFlow")
  distribution_lib.set_distribution = function
  keras.distribution.set_distribution = function
