"""How TensorFlow's checkpointing sees an object: the hooks tfpar overrides
per object so that `tf.train.Checkpoint` saves whole weights and slots
(concatenated shards or experts) and restores each device's part.

`_serialize_to_tensors` / `_restore_from_tensors` and
`_trackable_children` / `_lookup_dependency` are the methods TensorFlow's
`Trackable` documents for custom saving; they are private by name only.
Classes of tfpar's own that subclass `Trackable` override them directly;
these functions override them on one existing object.
"""

from tfpar._compat.checks import require
from tfpar._compat.tf_modules import trackable_base

for _name in ("_serialize_to_tensors", "_restore_from_tensors",
              "_trackable_children", "_lookup_dependency"):
  require(trackable_base.Trackable, _name, "checkpointing whole weights")


def override_saved_tensors(trackable, serialize, restore):
  """Makes `tf.train.Checkpoint` save `serialize()` ({name: tensor}) for
  `trackable` and restore it through `restore(tensors)`."""
  object.__setattr__(trackable, "_serialize_to_tensors", serialize)
  object.__setattr__(trackable, "_restore_from_tensors", restore)


def trackable_children(trackable):
  """The bound `_trackable_children` of `trackable` (before overriding)."""
  return trackable._trackable_children  # pylint: disable=protected-access


def override_children(trackable, children):
  """Makes `tf.train.Checkpoint` see `children(save_type, **kwargs)` as
  `trackable`'s dependencies (and look them up by name)."""
  def lookup_dependency(name, cached_dependencies=None):
    if cached_dependencies and name in cached_dependencies:
      return cached_dependencies[name]
    return children().get(name)

  object.__setattr__(trackable, "_trackable_children", children)
  object.__setattr__(trackable, "_lookup_dependency", lookup_dependency)
