"""A layer's `weights` listing a view of what it holds (whole weights).

Keras builds `Layer.weights` from a layer's own variable lists and its
sub-layers' `weights`, and derives `trainable_weights` /
`non_trainable_weights` from `weights`; TensorFlow's trainer takes
gradients for, and applies them to, `model.trainable_weights`, and `fit`
builds the optimizer from `trainable_variables` (built from the same lists,
not from `weights`). A tensor-parallel layer holds shard variables in those
lists. `show_weights_as(layer, view)` makes `layer.weights` list
`view(held)` (the shards of a weight replaced by the whole weight) while
`trainable_weights`, `non_trainable_weights` and the `*_variables` keep
listing the variables held, the ones training must use.

Keras has no per-instance hook for a property, so the layer's class becomes
a subclass of its class with the same name, module and qualified name, and
`layer.__class__` still answers the original class: Keras's serialization
(`model.save`, `get_config`), `clone_model` and summaries see the class the
user built. Only `type(layer)` shows the subclass.
"""

import contextlib
import threading

import keras

from tfpar._compat.checks import Incompatible
from tfpar._compat.checks import require

_PROPERTIES = ("weights", "trainable_weights", "non_trainable_weights",
               "trainable_variables")
for _name in _PROPERTIES:
  if not isinstance(require(keras.layers.Layer, _name, "whole weights"),
                    property):
    raise Incompatible(
        f"tfpar needs keras.layers.Layer.{_name} to be a property (listing "
        f"whole weights); this Keras version changed it.")

_state = threading.local()
_classes = {}
_OBJECT_CLASS = object.__dict__["__class__"]  # object's own __class__ slot.


@contextlib.contextmanager
def _flag(name):
  """Within it, this thread's `_state.<name>` is True."""
  previous = getattr(_state, name, False)
  setattr(_state, name, True)
  try:
    yield
  finally:
    setattr(_state, name, previous)


def _holding():
  """Within it, swapped layers' `weights` list the variables they hold."""
  return _flag("holding")


def listing_whole():
  """Within it, swapped layers' `trainable_weights` and
  `non_trainable_weights` list the view too (what `summary` counts: one
  variable holding a weight's shard on every device would count as the
  shard)."""
  return _flag("whole")


class _ShowsView:
  """Mixin: `weights` is the view, `*_weights` stay the held variables."""

  @property
  def weights(self):
    held = super().weights
    if getattr(_state, "holding", False):
      return held
    return self._tfpar_weights_view(held)

  @property
  def trainable_weights(self):
    if getattr(_state, "whole", False):
      return [w for w in self.weights if w.trainable]
    with _holding():
      return super().trainable_weights

  @property
  def non_trainable_weights(self):
    if getattr(_state, "whole", False):
      return [w for w in self.weights if not w.trainable]
    with _holding():
      return super().non_trainable_weights


def _get_class(self):
  return type(self)._tfpar_shown_class  # pylint: disable=protected-access


def _set_class(self, value):
  _OBJECT_CLASS.__set__(self, value)


def _swapped(cls):
  if cls not in _classes:
    swapped = type(cls.__name__, (_ShowsView, cls), {
        "__class__": property(_get_class, _set_class),
        "_tfpar_shown_class": cls})
    swapped.__module__, swapped.__qualname__ = cls.__module__, cls.__qualname__
    _classes[cls] = swapped
  return _classes[cls]


def held_weights(layer):
  """`layer.weights` as Keras lists them without a view: the variables the
  layer and its sub-layers hold (tensor shards, not whole weights)."""
  with _holding():
    return list(layer.weights)


def show_weights_as(layer, view):
  """Makes `layer.weights` (and what Keras derives from it: `get_weights`,
  `set_weights`, `count_params`) list `view(held_weights(layer))`.

  `trainable_weights` / `non_trainable_weights` keep listing the held
  variables. Checked: the trainer's list (`trainable_weights`) and the
  optimizer's (`trainable_variables`) must stay the same variables.

  Args:
    layer: a Keras layer or model.
    view: a function from the held list to the list `weights` shows.
  """
  object.__setattr__(layer, "_tfpar_weights_view", view)
  if not isinstance(layer, _ShowsView):
    _OBJECT_CLASS.__set__(layer, _swapped(type(layer)))
  trainer = [id(v) for v in layer.trainable_weights]
  optimizer = [id(v) for v in layer.trainable_variables]
  if sorted(trainer) != sorted(optimizer):
    raise Incompatible(
        f"tfpar: after listing whole weights in {layer.name!r}.weights, its "
        f"trainable_weights ({len(trainer)}) and trainable_variables "
        f"({len(optimizer)}) differ: this Keras version derives one of them "
        f"differently. Update tfpar/_compat/keras_weights_view.py.")
