"""The layout map inside a `keras.distribution.ModelParallel`.

Keras keeps it only in a private attribute; `tfpar.from_keras_distribution`
reads it to split the same weights on TensorFlow.
"""

from tfpar._compat.checks import require


def layout_map(distribution):
  """The `keras.distribution.LayoutMap` a `ModelParallel` was made with."""
  return require(distribution, "_layout_map", "the ModelParallel layout map")
