"""The parts of `keras.distribution` tfpar reads or replaces.

Keras keeps a `ModelParallel`'s layout map only in a private attribute;
`tfpar.from_keras_distribution` reads it to split the same weights on
TensorFlow. `keras.distribution.set_distribution` is a function of Keras's
private `distribution_lib` module, which `Distribution.scope()` looks up
there at each call; tfpar replaces it (in that module and in the public
`keras.distribution` namespace) to make the distribution's strategy
TensorFlow's default. Keras's TensorFlow backend has no `distribute_tensor`,
which Keras calls on a layer's output when a layout map has an entry for
it (`<layer path>/output`); tfpar adds one that leaves the tensor as it is.
"""

import warnings

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


def _is_layout_map_entry(layout):
  """Whether `layout` is an entry of the set `ModelParallel`'s layout map
  (what Keras relays a layer's output with), not a layout Keras made for a
  batch (`get_data_layout`: keras-hub's `generate` lays out its inputs so)."""
  current = require(distribution_lib, "distribution",
                    "the distribution keras.distribution set")()
  if not isinstance(current, keras.distribution.ModelParallel):
    return False
  return any(entry is layout for entry in layout_map(current).values())


def _distribute_tensor(tensor, layout):
  """Keras's relayout of a layer's output, on TensorFlow: tfpar's strategy
  lays out activations itself; the value is the same. (Python shows the
  warning once per layout.) A batch laid out over the data axis (the
  inputs of keras-hub's `generate`) is left as it is silently: tfpar's
  strategy runs its `generate` itself."""
  if not _is_layout_map_entry(layout):
    return tensor
  warnings.warn(
      f"keras.distribution: a LayoutMap entry lays out a layer's output "
      f"(TensorLayout axes={tuple(layout.axes)}); on TensorFlow tfpar's "
      f"strategy lays out activations itself and leaves such entries "
      f"out. Received: layout={layout!r}", stacklevel=2)
  return tensor


def install_output_layouts():
  """Gives Keras's TensorFlow backend the `distribute_tensor` Keras calls
  for a layout map's `.../output` entries, unless it has one."""
  backend_lib = require(distribution_lib, "distribution_lib",
                        "the backend's distribution functions")
  if getattr(backend_lib, "distribute_tensor", None) is None:
    backend_lib.distribute_tensor = _distribute_tensor
