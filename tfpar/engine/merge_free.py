"""Optimizer updates without `merge_call`, so they can run inside `tf.cond`.

Keras applies `gradient_accumulation_steps` inside a `tf.cond` (accumulate,
or update and reset), and its TensorFlow optimizer reaches the strategy
through `merge_call`, which TF refuses inside a cond ("`merge_call` called
while defining a new graph or a tf.function"; keras-team/keras#17429,
tensorflow/tensorflow#59487: stock MirroredStrategy fails the same way).

TF's collective strategies have a designed mode without `merge_call` (used
for XLA on GPUs): a replica-context all-reduce launches its collectives
from the replica itself, and `extended.update` in replica context updates
the replica's own copy of a mirrored variable. While a replica thread is
inside `without_merge_call()`, tfpar's strategies run in that mode. With it:

* an accumulating micro-step only adds each replica's gradients to its own
  accumulators: nothing crosses replicas (PyTorch DDP's `no_sync`);
* the update micro-step all-reduces the accumulated gradients once and
  every replica applies the same update to its copy, as `merge_call` would.
"""

import contextlib
import threading

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat.tf_modules import nest

from tfpar.engine import grouping


class MergeFreeUpdates:
  """Mixin of `MeshExtended`: the strategy's no-`merge_call` mode, per
  replica thread, and its all-reduce by device column (a tensor shard's or
  a pipeline stage's gradients are reduced where they live)."""

  def _init_merge_free(self):
    self._merge_free = threading.local()

  @contextlib.contextmanager
  def without_merge_call(self):
    """Inside, this replica's all-reduces and variable updates do not use
    `merge_call` (graph mode only: eager replicas run one after the other,
    and their collectives would wait for each other)."""
    previous = getattr(self._merge_free, "active", False)
    self._merge_free.active = True
    try:
      yield
    finally:
      self._merge_free.active = previous

  def merge_free_active(self):
    """Whether this replica thread is inside `without_merge_call()`."""
    return getattr(self._merge_free, "active", False)

  def _use_merge_call(self):
    if self.merge_free_active() and not tf.executing_eagerly():
      return False
    return super()._use_merge_call()

  def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
    if not self.merge_free_active():
      return super()._replica_ctx_all_reduce(reduce_op, value, options)
    flat = nest.flatten(value)
    groups = grouping.reduction_groups([self.column_of(v) for v in flat],
                                       flat)
    replica_id = distribute.local_replica_index(
        tf.distribute.get_replica_context())
    options = self._communication_options.merge(
        options or tf.distribute.experimental.CommunicationOptions())
    results = [None] * len(flat)
    for (column, _), indices in groups.items():
      ops = (self._cross_device_ops if column == 0 else
             self.column_cross_device_ops(column))
      reduced = distribute.all_reduce(
          ops, reduce_op, [flat[i] for i in indices], replica_id, options)
      for index, result in zip(indices, reduced):
        results[index] = result
    return nest.pack_sequence_as(value, results)
