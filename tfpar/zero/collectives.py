"""The collectives of ZeRO, issued by each replica on its own device.

They go straight to the strategy's per-replica collective launcher, without
`merge_call`, so they also work inside `tf.cond` (gradient accumulation).
TensorFlow has no reduce-scatter kernel on CPU (`CollectiveReduceScatterV2`
is GPU-only), so the reduce-scatter is an all-to-all followed by a local
sum, which moves the same bytes. Every op is recorded in open
`tfpar.CommunicationLog`s with the bytes this device sends.
"""

import weakref

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.ops import collective_ops

from tfpar import engine
from tfpar.tensor_parallel import instrument

OPTIMIZER = "optimizer"  # Phase of the collectives of the update step.


def _strategy_ops(strategy, column):
  """The strategy's own `CollectiveAllReduce` for `column`."""
  extended = strategy.extended
  if column:  # Shard `column` of a tensor-parallel weight.
    return extended._column_cross_device_ops(column)  # pylint: disable=protected-access
  for name in ("_collective_ops", "_cross_device_ops",
               "_inferred_cross_device_ops"):
    ops = getattr(extended, name, None)
    if isinstance(ops, cross_device_ops_lib.CollectiveAllReduce):
      return ops
  raise ValueError(
      f"tfpar.ZeRO needs a strategy that runs collective ops "
      f"(MirroredStrategy, MultiWorkerMirroredStrategy or a tfpar "
      f"strategy); {type(strategy).__name__} uses "
      f"{type(getattr(extended, '_cross_device_ops', None)).__name__}.")


# ZeRO's collectives run in groups of their own, over the strategy's devices
# but with collective keys from tfpar's range: every stock MirroredStrategy
# takes group key 1, so ZeRO's all-to-alls would otherwise share instance
# keys with another stock strategy's all-reduces in the same process
# ("Collective instance 100 expected type 0 ... but got type 4").
_zero_ops = weakref.WeakKeyDictionary()  # extended -> {column: ops}


def _launcher(context, column=None):
  column = column or None  # 0 and None: the replica heads.
  per_column = _zero_ops.setdefault(context.strategy.extended, {})
  if column not in per_column:
    ops = _strategy_ops(context.strategy, column)
    keys = cross_device_utils.CollectiveKeys(
        group_key_start=1 + engine.next_collective_key_base())
    per_column[column] = cross_device_ops_lib.CollectiveAllReduce(
        devices=ops._devices, group_size=ops._group_size,  # pylint: disable=protected-access
        options=ops._options, collective_keys=keys)  # pylint: disable=protected-access
  return per_column[column]._launchers[context._replica_id]  # pylint: disable=protected-access


def all_gather(flat_slice, phase, name, column=None):
  """Concatenates every replica's slice, in replica order.

  Args:
    flat_slice: this replica's slice.
    phase: "forward", "backward" or "optimizer" (for the log).
    name: the weight's path (for the log).
    column: under tensor parallelism, the index of the devices holding the
      slices within each replica (None or 0: the replica heads).
  """
  context = tf.distribute.get_replica_context()
  launcher = _launcher(context, column)
  count = context.num_replicas_in_sync
  instrument.record("all-gather", phase,
                    instrument.moved_bytes(flat_slice, count - 1), name)
  return launcher._all_gather(flat_slice, None)  # pylint: disable=protected-access


def reduce_scatter(flat, phase, name, column=None):
  """This replica's slice of the sum over replicas of `flat` (a vector
  whose length is a multiple of the replica count); arguments as for
  `all_gather`."""
  context = tf.distribute.get_replica_context()
  launcher = _launcher(context, column)
  count = context.num_replicas_in_sync
  chunks = tf.reshape(flat, [count, -1])
  instrument.record("reduce-scatter", phase,
                    instrument.moved_bytes(chunks[0], count - 1), name)
  instance_key = launcher._next_instance_key()  # pylint: disable=protected-access
  with tf.device(launcher._device):  # pylint: disable=protected-access
    received = collective_ops.all_to_all_v2(
        chunks, launcher._group_size, launcher._group_key, instance_key,  # pylint: disable=protected-access
        ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access
    return tf.reduce_sum(tf.reshape(received, [count, -1]), axis=0)


def all_reduce_sum(values, phase, name):
  """The sum over replicas of a small vector (gradient norms)."""
  context = tf.distribute.get_replica_context()
  count = context.num_replicas_in_sync
  # A ring all-reduce sends 2 (N - 1) / N of the vector from each device.
  instrument.record("all-reduce", phase,
                    instrument.moved_bytes(values, 2) * (count - 1) // count,
                    name)
  return _launcher(context).all_reduce(values)


def all_gather_rows(rows, phase, name, column=None):
  """Every replica's rows of an `IndexedSlices`, concatenated in replica
  order (what MirroredStrategy's all-reduce of `IndexedSlices` gives);
  arguments as for `all_gather`."""
  context = tf.distribute.get_replica_context()
  launcher = _launcher(context, column)
  count = context.num_replicas_in_sync
  sent = None
  if rows.values.shape.is_fully_defined():
    sent = (instrument.moved_bytes(rows.values, count - 1) +
            instrument.moved_bytes(rows.indices, count - 1))
  instrument.record("all-gather", phase, sent, name)
  return launcher.all_reduce_indexed_slices(rows)
