"""The collectives of ZeRO, issued by each replica on its own device.

They go straight to the strategy's per-replica collective launcher, without
`merge_call`, so they also work inside `tf.cond` (gradient accumulation).
TensorFlow has no reduce-scatter kernel on CPU (`CollectiveReduceScatterV2`
is GPU-only), so the reduce-scatter is an all-to-all followed by a local
sum, which moves the same bytes. Every op is recorded in open
`tfpar.CommunicationLog`s with the bytes this device sends.

The optimizer step's collectives are bucketed (`reduce_scatter_many`,
`all_gather_many`): the weights' slices travel together in one op per
bucket. Besides fewer, larger messages, this keeps memory flat: TensorFlow
gives each collective launch a new instance key, and its runtime keeps a
record per key for the life of the process (about 300 bytes per key and
device, measured), so per-weight collectives grew the process by that much
per weight and step.

Stage 3's collectives (the gathers of the forward pass and of the
recomputed backward pass, and the gradients' reduce-scatters, one per
bucket of weights, `tfpar.zero.buckets`) take
fixed instance keys instead (`fixed_key`): each key is a function of what
the collective moves (the weight, the kind of collective, its dtype, and
how many such collectives of that weight the traced function already
launched), so every worker computes the same keys whatever else it
traced, a call reuses its function's keys, and a key always goes with the
same collective type, dtype and shape (TensorFlow pins those per key).
"""

import itertools
import threading
import weakref

import tensorflow as tf

from tfpar import engine
from tfpar._compat import distribute
from tfpar._compat import traced_keys
from tfpar._compat.tf_modules import cross_device_utils
from tfpar.common import instrument
from tfpar.common import strategy_hooks

OPTIMIZER = "optimizer"  # Phase of the collectives of the update step.
# Bucket size of the update step's collectives (PyTorch DDP's is 25 MB).
DEFAULT_BUCKET_BYTES = 32 * 2**20


def _strategy_ops(strategy, column):
  """The strategy's own `CollectiveAllReduce` for `column`."""
  extended = strategy.extended
  if column:  # Shard `column` of a tensor-parallel weight.
    return extended.column_cross_device_ops(column)
  ops = distribute.strategy_collective_ops(extended)
  if ops is not None:
    return ops
  raise ValueError(
      f"tfpar.ZeRO needs a strategy that runs collective ops "
      f"(MirroredStrategy, MultiWorkerMirroredStrategy or a tfpar "
      f"strategy); {type(strategy).__name__} uses "
      f"{distribute.cross_device_ops_name(extended)}.")


# ZeRO's collectives run in groups of their own, over the strategy's devices
# but with collective keys from tfpar's range: every stock MirroredStrategy
# takes group key 1, so ZeRO's all-to-alls would otherwise share instance
# keys with another stock strategy's all-reduces in the same process
# ("Collective instance 100 expected type 0 ... but got type 4").
_zero_ops = weakref.WeakKeyDictionary()  # extended -> {column: ops}


def launcher(context, column=None):
  """The launcher of ZeRO's group for `context`'s replica (`column`: as
  for `all_gather`)."""
  extended = context.strategy.extended
  index = distribute.local_replica_index(context)
  # Per-device (SPMD) strategies: one trace per device.
  position = strategy_hooks.of(context.strategy).zero_trace(column)
  if position is not None:  # The trace's column of the weight's devices.
    column, index = position
  column = column or None  # 0 and None: the replica heads.
  per_column = _zero_ops.setdefault(extended, {})
  if column not in per_column:
    ops = _strategy_ops(context.strategy, column)
    keys = cross_device_utils.CollectiveKeys(
        group_key_start=1 + engine.next_collective_key_base())
    group, all_local = distribute.regrouped(ops, keys)
    if all_local:  # Keys fixed at trace time keep memory flat.
      traced_keys.draw_keys_when_traced(distribute.launchers(group))
    per_column[column] = group
  return distribute.launchers(per_column[column])[index]


_launcher = launcher


# Fixed instance keys (`fixed_key`). A site is a number every worker gives
# the same weight: weights take them in the order they are sharded, as
# every worker shards the same models in the same order (TensorFlow's own
# strategies rely on the same order to broadcast initial values).
_KINDS = {("all-gather", instrument.FORWARD): 0,
          ("all-gather", instrument.BACKWARD): 1,
          ("reduce-scatter", instrument.BACKWARD): 2,
          ("reduce-scatter", instrument.FORWARD): 3}
_DTYPES = 32  # TensorFlow's DataType enum of the collective's input.
_OCCURRENCES = 64  # Per site, kind, dtype and traced function.
_KEYS_PER_SITE = len(_KINDS) * _DTYPES * _OCCURRENCES
_SITES = len(distribute.FIXED_INSTANCE_KEYS) // _KEYS_PER_SITE
_site_counters = weakref.WeakKeyDictionary()  # extended -> count()
_launched = weakref.WeakKeyDictionary()  # traced function graph -> {...}
_launched_lock = threading.Lock()  # Replicas are traced in threads.


def new_site(strategy):
  """The next site of `strategy`'s ZeRO groups, for a weight being
  sharded (see `fixed_key`)."""
  with _launched_lock:
    return next(_site_counters.setdefault(strategy.extended,
                                          itertools.count()))


def fixed_key(launcher, site, op, phase, dtype):
  """The instance key of the collective `op` ("all-gather" or
  "reduce-scatter") of `phase` on the weight of `site`, in `dtype`, that
  the function being traced launches next on `launcher`'s device; None
  (the launcher's own key) when executing eagerly, or for a collective
  out of the fixed keys' range.

  The key depends only on the weight, the collective's kind and dtype,
  and how many of the same the traced function launched before on that
  device: not on what else a worker traced, so every worker agrees. Two
  collectives of one function never share a key; one key may serve
  several functions (train and evaluate), which run one after the other,
  as a function's keys serve each of its calls.
  """
  kind = _KINDS.get((op, phase))
  graph = distribute.traced_function_graph()
  code = dtype.as_datatype_enum
  if (site is None or kind is None or graph is None or code >= _DTYPES or
      site >= _SITES):
    return None
  slot = (distribute.launcher_device(launcher), site, kind, code)
  with _launched_lock:
    launched = _launched.setdefault(graph, {})
    occurrence = launched.get(slot, 0)
    launched[slot] = occurrence + 1
  if occurrence >= _OCCURRENCES:
    return None
  return distribute.FIXED_INSTANCE_KEYS[
      ((site * len(_KINDS) + kind) * _DTYPES + code) * _OCCURRENCES +
      occurrence]


def all_gather(flat_slice, phase, name, column=None, site=None):
  """Concatenates every replica's slice, in replica order.

  Args:
    flat_slice: this replica's slice.
    phase: "forward", "backward" or "optimizer" (for the log).
    name: the weight's path (for the log).
    column: under tensor parallelism, the index of the devices holding the
      slices within each replica (None or 0: the replica heads).
    site: the weight's site (`new_site`): the gather takes a fixed
      instance key (`fixed_key`); None: a new key per call.
  """
  context = tf.distribute.get_replica_context()
  launcher = _launcher(context, column)
  count = context.num_replicas_in_sync
  instrument.record("all-gather", phase,
                    instrument.moved_bytes(flat_slice, count - 1), name)
  key = fixed_key(launcher, site, "all-gather", phase, flat_slice.dtype)
  return distribute.all_gather(launcher, flat_slice, key)


def reduce_scatter(flat, phase, name, column=None, site=None):
  """This replica's slice of the sum over replicas of `flat` (a vector
  whose length is a multiple of the replica count); arguments as for
  `all_gather`."""
  context = tf.distribute.get_replica_context()
  launcher = _launcher(context, column)
  count = context.num_replicas_in_sync
  chunks = tf.reshape(flat, [count, -1])
  instrument.record("reduce-scatter", phase,
                    instrument.moved_bytes(chunks[0], count - 1), name)
  key = fixed_key(launcher, site, "reduce-scatter", phase, chunks.dtype)
  received = distribute.all_to_all(launcher, chunks, key)
  with tf.device(distribute.launcher_device(launcher)):
    return tf.reduce_sum(tf.reshape(received, [count, -1]), axis=0)


def buckets(flats, columns, bucket_bytes):
  """Groups of indices of `flats` that can travel in one collective: same
  device column and dtype, in order, each group at most `bucket_bytes`
  (a single larger tensor forms a group of its own).

  Example:

  >>> flats = [tf.zeros([4]), tf.zeros([4], tf.int32), tf.zeros([4])]
  >>> buckets(flats, [None, None, None], bucket_bytes=64)
  [[0, 2], [1]]
  >>> buckets(flats, [None, None, None], bucket_bytes=16)
  [[0], [1], [2]]
  """
  open_groups, groups = {}, []  # (column, dtype) -> (indices, bytes)
  for index, (flat, column) in enumerate(zip(flats, columns)):
    key = (column or None, flat.dtype)
    size = flat.shape.num_elements() * flat.dtype.size
    members, used = open_groups.get(key, (None, 0))
    if members is None or used + size > bucket_bytes:
      members, used = [], 0
      groups.append(members)
    members.append(index)
    open_groups[key] = (members, used + size)
  return groups


def reduce_scatter_many(flats, phase, names, columns, bucket_bytes):
  """`reduce_scatter` of each of `flats`, bucketed (see `buckets`): one
  all-to-all per bucket.

  Args:
    flats: vectors whose lengths are multiples of the replica count.
    phase: as for `all_gather`.
    names: each vector's weight path (for the log).
    columns: each vector's device column (see `all_gather`).
    bucket_bytes: the most bytes of `flats` one collective carries.

  Returns:
    This replica's slice of the sum over replicas of each vector.
  """
  context = tf.distribute.get_replica_context()
  count = context.num_replicas_in_sync
  results = [None] * len(flats)
  for group in buckets(flats, columns, bucket_bytes):
    chunks = [tf.reshape(flats[i], [count, -1]) for i in group]
    for i, chunk in zip(group, chunks):
      instrument.record("reduce-scatter", phase,
                        instrument.moved_bytes(chunk[0], count - 1), names[i])
    launcher = _launcher(context, columns[group[0]])
    joined = tf.concat(chunks, axis=1) if len(chunks) > 1 else chunks[0]
    received = distribute.all_to_all(launcher, joined)
    with tf.device(distribute.launcher_device(launcher)):
      summed = tf.reduce_sum(tf.reshape(received, [count, -1]), axis=0)
      pieces = tf.split(summed, [c.shape[1] for c in chunks])
    for i, piece in zip(group, pieces):
      results[i] = piece
  return results


def all_gather_many(pieces, phase, names, columns, bucket_bytes):
  """`all_gather` of each of `pieces` (this replica's slices), bucketed
  (see `buckets`): one all-gather per bucket; arguments as for
  `reduce_scatter_many`.

  Returns:
    For each slice, every replica's slice concatenated in replica order.
  """
  context = tf.distribute.get_replica_context()
  count = context.num_replicas_in_sync
  results = [None] * len(pieces)
  for group in buckets(pieces, columns, bucket_bytes):
    for i in group:
      instrument.record("all-gather", phase,
                        instrument.moved_bytes(pieces[i], count - 1),
                        names[i])
    launcher = _launcher(context, columns[group[0]])
    parts = [pieces[i] for i in group]
    joined = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
    gathered = distribute.all_gather(launcher, joined)
    with tf.device(distribute.launcher_device(launcher)):
      per_replica = tf.split(tf.reshape(gathered, [count, -1]),
                             [p.shape[0] for p in parts], axis=1)
      for i, whole in zip(group, per_replica):
        results[i] = tf.reshape(whole, [-1])
  return results


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
