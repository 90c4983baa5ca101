"""Private state of `tf.distribute` strategies, replica contexts and
collective launchers.

TensorFlow has no public API to launch a collective from one replica on
a group of its choosing (all-to-all, all-gather), to learn a replica's
index among the local devices, or to reach a strategy's cross-device ops;
tfpar's ZeRO and expert parallelism need all three. Every accessor checks
what it reads (`Incompatible` otherwise).
"""

import tensorflow as tf

from tfpar._compat import traced_keys
from tfpar._compat.checks import require
from tfpar._compat.tf_modules import collective_ops
from tfpar._compat.tf_modules import cross_device_ops_lib
from tfpar._compat.tf_modules import cross_device_utils
from tfpar._compat.tf_modules import distribute_lib

_LAUNCHER = cross_device_utils.CollectiveReplicaLauncher
for _name in ("_all_gather", "_get_ordering_token", "_next_instance_key",
              "all_reduce"):
  require(_LAUNCHER, _name, "collectives launched by one replica")
require(cross_device_ops_lib.CollectiveAllReduce, "_all_reduce",
        "all-reduce without merge_call")
require(distribute_lib.StrategyExtendedV2, "_container_strategy",
        "the strategy of an extended")
require(collective_ops, "all_gather_v2", "all-gathers with fixed keys")
require(tf.Graph, "building_function", "the function being traced")

# Instance keys tfpar fixes itself (`fixed_key` of `all_gather`), far above
# TensorFlow's: its `CollectiveKeys` start each group at 100 and count up
# by one per collective launch (a billion launches to get here).
FIXED_INSTANCE_KEYS = range(1 << 30, 1 << 31)


def group_size(launcher):
  """Members of a `CollectiveReplicaLauncher`'s group."""
  return require(launcher, "_group_size", "collective group size")


def launcher_device(launcher):
  """The device a launcher's collectives run on."""
  return require(launcher, "_device", "collective device")


def _instance_key(launcher, fixed):
  """The instance key tensor of a collective: `fixed` (an int of
  `FIXED_INSTANCE_KEYS`), or the launcher's own (a new one per call
  across workers)."""
  if fixed is None:
    return launcher._next_instance_key()  # pylint: disable=protected-access
  if fixed not in FIXED_INSTANCE_KEYS:
    raise ValueError(f"Instance key {fixed} is outside tfpar's fixed keys "
                     f"{FIXED_INSTANCE_KEYS}.")
  with tf.device("CPU:0"):
    return tf.constant(fixed, tf.int32)


def all_to_all(launcher, chunks, fixed_key=None):
  """TensorFlow's all-to-all over a launcher's group: chunk j of `chunks`
  (first dimension the group size) goes to member j; returns what each
  member sent this one, in member order. CPU has no reduce-scatter
  kernel, so ZeRO's reduce-scatter is built on this too. `fixed_key`: an
  instance key of `FIXED_INSTANCE_KEYS` that every call takes, or None
  for the launcher's."""
  with traced_keys.keyed_by(chunks):
    instance_key = _instance_key(launcher, fixed_key)
  with tf.device(launcher_device(launcher)):
    received = collective_ops.all_to_all_v2(
        chunks, group_size(launcher),
        require(launcher, "_group_key", "collective group key"),
        instance_key, ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access
  return received


def all_gather(launcher, tensor, fixed_key=None):
  """Every member's `tensor` concatenated along the first axis;
  `fixed_key` as for `all_to_all`."""
  if fixed_key is None:
    return launcher._all_gather(tensor, None)  # pylint: disable=protected-access
  instance_key = _instance_key(launcher, fixed_key)
  # As `CollectiveReplicaLauncher._all_gather`, with the key given.
  options = require(launcher, "_options", "collective options").merge(None)
  with tf.device(launcher_device(launcher)):
    return collective_ops.all_gather_v2(
        tensor, group_size(launcher),
        require(launcher, "_group_key", "collective group key"),
        instance_key, communication_hint=options.implementation.value,
        timeout=options.timeout_seconds,
        ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access


def traced_function_graph():
  """The function graph being traced, or None when executing eagerly (or
  building a TF1 graph). A branch of `tf.cond` or the body of a
  `tf.while_loop` counts as the function it is in, as TensorFlow counts it
  when it feeds instance keys (`CollectiveReplicaLauncher`)."""
  if tf.executing_eagerly():
    return None
  graph = tf.compat.v1.get_default_graph()
  while getattr(graph, "is_control_flow_graph", False):
    graph = require(graph, "outer_graph", "the graph a branch is in")
  return graph if graph.building_function else None


def strategy_collective_ops(extended):
  """The `CollectiveAllReduce` a strategy's extended runs, or None."""
  for name in ("_collective_ops", "_cross_device_ops",
               "_inferred_cross_device_ops"):
    ops = getattr(extended, name, None)
    if isinstance(ops, cross_device_ops_lib.CollectiveAllReduce):
      return ops
  return None


def cross_device_ops_name(extended):
  """The class name of a strategy's cross-device ops (for errors)."""
  return type(getattr(extended, "_cross_device_ops", None)).__name__


def regrouped(ops, collective_keys):
  """A `CollectiveAllReduce` over the devices of `ops`, drawing keys from
  `collective_keys`, and whether all its members are in this process."""
  devices = require(ops, "_devices", "collective devices")
  size = require(ops, "_group_size", "collective group size")
  group = cross_device_ops_lib.CollectiveAllReduce(
      devices=devices, group_size=size,
      options=require(ops, "_options", "collective options"),
      collective_keys=collective_keys)
  return group, size == len(devices)


def launchers(ops):
  """A `CollectiveAllReduce`'s per-local-device launchers."""
  return require(ops, "_launchers", "per-device collective launchers")


def all_reduce(ops, reduce_op, values, replica_index, options):
  """A `CollectiveAllReduce`'s all-reduce launched by one replica, without
  merge_call."""
  return ops._all_reduce(reduce_op, values, replica_index, options)  # pylint: disable=protected-access


def local_replica_index(context):
  """The index of a replica context's device among this worker's."""
  return require(context, "_replica_id", "local replica index")


def container_strategy(extended):
  """The `tf.distribute.Strategy` a `StrategyExtended` belongs to."""
  return extended._container_strategy()  # pylint: disable=protected-access


def communication_options(extended):
  """A strategy's default `CommunicationOptions`."""
  return require(extended, "_communication_options",
                 "communication options")


def cluster_resolver(extended):
  """The cluster resolver a strategy's extended was built from."""
  return require(extended, "_cluster_resolver", "cluster resolver")


def id_in_cluster(extended):
  """This worker's index in a multi-worker strategy (0 on one host)."""
  return getattr(extended, "_id_in_cluster", 0)


def local_component(distributed):
  """The calling replica's component of a distributed variable."""
  return distributed._get()  # pylint: disable=protected-access


def strategy_ordinal(strategy):
  """Which multi-worker strategy of this process `strategy` is (TF gives
  each a collective key base 100,000 apart), for messages."""
  return getattr(strategy, "_collective_key_base", 0) // 100_000
