"""TensorFlow's private modules tfpar uses, each checked at import for the
names tfpar calls (`Incompatible` if one moved).

Why each is needed is in docs/design.md; in short: `tf.distribute` exposes
no public collective launcher, per-replica value types, cross-device ops
or strategy base class to subclass; the coordination service and its
key-value store are reached only through the eager context.
"""

# pylint: disable=g-direct-tensorflow-import,unused-import
from tensorflow.core.framework import summary_pb2
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.eager import context as eager_context
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import data_structures
from tensorflow.python.util import nest

from tfpar._compat.checks import require

_NEEDED = {
    summary_pb2: ("SummaryMetadata",),
    collective_all_reduce_strategy: ("CollectiveAllReduceExtended",),
    collective_util: ("Options",),
    cross_device_ops_lib: ("CollectiveAllReduce",),
    cross_device_utils: ("CollectiveKeys", "CollectiveReplicaLauncher"),
    distribute_lib: ("Strategy", "StrategyExtendedV2"),
    multi_worker_util: ("coordination_leader", "id_in_cluster"),
    values_lib: ("DistributedValues", "PerReplica", "SyncOnReadVariable"),
    eager_context: ("context",),
    collective_ops: ("all_to_all_v2",),
    resource_variable_ops: ("ResourceVariable",),
    trackable_base: ("Trackable",),
    data_structures: ("ListWrapper",),
    nest: ("flatten", "is_nested", "map_structure", "pack_sequence_as"),
}
for _module, _names in _NEEDED.items():
  for _name in _names:
    require(_module, _name, "tfpar's strategies and collectives")


def coordination_config_pb2():
  """TensorFlow's coordination service config proto module (imported on
  first use: only multi-worker jobs need it)."""
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2 as pb2  # pylint: disable=g-import-not-at-top
  return pb2
