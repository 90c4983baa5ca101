"""`tf.train.Checkpoint` of an optimizer whose weights are held in pieces.

Keras's optimizer tracks its lists of variables (`_trainable_variables`,
`_variables`) for `tf.train.Checkpoint`. With split weights they hold
shards, and slots of shard shape, so the checkpoint would not load into
another layout. `install` makes the checkpoint see each list as an
unsharded model's optimizer has it: whole weights and whole slots
(`LogicalTensor`s over the pieces), in the same order, under the same
names.
"""

from tfpar._compat import checkpointing
from tfpar._compat.tf_modules import data_structures
from tfpar.common.split_weights import LogicalTensor


def install(optimizer, version, whole_list):
  """Makes `tf.train.Checkpoint` save and restore `optimizer`'s variable
  lists whole.

  Args:
    optimizer: a Keras optimizer of a model with split weights.
    version: `version()` changes when the split weights do (e.g. their
      count); the whole lists are made again then.
    whole_list: `whole_list(items, slots)`, the list `items` as an
      unsharded optimizer has it; `slots` (a dict) memoizes whole slots
      across lists, so lists sharing a slot share its `LogicalTensor`
      (a checkpoint saves it once).
  """
  original_children = checkpointing.trackable_children(optimizer)
  cache = {}  # Checkpointing needs the same objects on every call.

  def whole_lists(children):
    key = (version(),) + tuple(
        (name, id(child), len(child)) for name, child in children.items()
        if isinstance(child, list))
    if cache.get("key") != key:
      cache.clear()
      cache["key"] = key
      cache["lists"] = {}
      slots = {}
      for name, child in children.items():
        if isinstance(child, list):
          entries = whole_list(child, slots)
          if any(isinstance(e, LogicalTensor) for e in entries):
            cache["lists"][name] = data_structures.ListWrapper(entries)
    return cache["lists"]

  def trackable_children(save_type="checkpoint", **kwargs):
    children = dict(original_children(save_type, **kwargs))
    if optimizer.built:
      children.update(whole_lists(children))
    return children

  checkpointing.override_children(optimizer, trackable_children)
