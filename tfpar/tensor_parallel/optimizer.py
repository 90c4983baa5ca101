"""What a tensor-parallel model's optimizer does differently.

* Its checkpoints hold whole logical slots (the Adam moments of a split
  weight as one tensor), so they load into any tensor size.
* It clips gradients after the cross-replica all-reduce and by the norms of
  whole logical weights, which is what one device computes. (Keras clips
  each replica's partial gradient before the all-reduce, and would clip each
  shard by its own norm.)
"""

import numpy as np

from tfpar._compat import keras_layers
from tfpar.common import clipping
from tfpar.common import optimizer_checkpoint
from tfpar.common.split_weights import logical_entries
from tfpar.common.split_weights import sharded_weights
from tfpar.engine import whole_state


def adopt(optimizer, model):
  """Makes `optimizer` save logical slots and clip like one device.

  Args:
    optimizer: the Keras optimizer of `model`, not yet built.
    model: the sharded model.
  """
  if getattr(optimizer, "_tfpar_adopted", False):
    return
  _install_logical_saving(optimizer, model)
  _install_logical_checkpoint(optimizer, model)
  _install_logical_clipping(optimizer, model)
  object.__setattr__(optimizer, "_tfpar_adopted", True)


def rebuild_for_shards(model, prepare=None, entries_of=None):
  """Replaces `model.optimizer`, built for the weights before sharding, by a
  twin built for the shards that carries over its whole state.

  Args:
    model: a model just sharded whose optimizer is built.
    prepare: `prepare(twin)` before it is built; default `adopt`.
    entries_of: `entries_of(twin)`, the twin's state in the old one's
      order, whole; default `logical_entries` over the shards.

  Raises:
    ValueError: the twin's whole state does not match the old one's.
  """
  old = model.optimizer
  state = [np.asarray(v.numpy()) for v in old.variables]
  new = type(old).from_config(old.get_config())
  (prepare or (lambda twin: adopt(twin, model)))(new)
  new.build(model.trainable_variables)
  entries = (entries_of(new) if entries_of else
             logical_entries(new.variables, sharded_weights(model)))
  if len(entries) != len(state):
    raise ValueError(
        f"Cannot carry the state of optimizer {old.name!r} over to the "
        f"sharded model: it had {len(state)} variables, its sharded twin "
        f"{len(entries)}.")
  for entry, value in zip(entries, state):
    entry.assign(value)
  model.optimizer = new


def _install_logical_saving(optimizer, model):
  whole_state.save_whole_state(optimizer, lambda: logical_entries(
      optimizer.variables, sharded_weights(model)))


def _install_logical_checkpoint(optimizer, model):
  """tf.train.Checkpoint sees the optimizer's variable lists as an unsharded
  model's optimizer has them (whole weights, whole slots)."""
  optimizer_checkpoint.install(
      optimizer, lambda: len(sharded_weights(model)),
      lambda items, slots: logical_entries(items, sharded_weights(model),
                                           slots))


def _shard_groups(model):
  """{id of a shard's tf.Variable: (logical path, shard count)}."""
  groups = {}
  for weight in sharded_weights(model).values():
    for shard in weight.shards:
      groups[id(keras_layers.storage(shard))] = weight.path
  return groups


def _install_logical_clipping(optimizer, model):
  clipping.clip_after_all_reduce(optimizer, lambda: _shard_groups(model))
