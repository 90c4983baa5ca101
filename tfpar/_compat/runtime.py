"""TensorFlow's runtime state tfpar reads: the eager context (the
coordination service and its key-value store, collective aborts, the
server of a multi-worker strategy), `tf.data` datasets' batch sizes, graph
ops' statefulness and a TPU resolver's topology.

TensorFlow exposes the coordination service's key-value store and
`abort_collective_ops` only on its eager context; a batched dataset's batch
size only on its private attributes. Each accessor checks what it reads.
"""

import inspect

from tfpar._compat.checks import Incompatible
from tfpar._compat.checks import require
from tfpar._compat.checks import versions
from tfpar._compat.tf_modules import coordination_config_pb2
from tfpar._compat.tf_modules import eager_context
from tfpar._compat.tf_modules import multi_worker_util

# The op types of TensorFlow's transfers between devices, as a profile
# names them (internal ops: a pipeline trace tells them from stage work).
TRANSFER_OP_TYPES = ("_Recv", "_Send", "_HostRecv", "_HostSend")

for _name in ("abort_collective_ops", "configure_coordination_service",
              "get_config_key_value", "set_config_key_value"):
  require(eager_context.Context, _name, "multi-worker coordination")


def context():
  """TensorFlow's eager context (the process's runtime)."""
  return eager_context.context()


def abort_collective_ops(code, message):
  """Fails every pending collective of this process with `message`."""
  context().abort_collective_ops(code, message)


def server_started():
  """Whether this process already runs a TensorFlow server for collectives
  (the first `MultiWorkerMirroredStrategy` starts it; later ones reuse it)."""
  ctx = context()
  return bool(getattr(ctx, "_collective_ops_server_def", None) or
              getattr(ctx, "_server_def", None))


def collective_server_def():
  """The `ServerDef` this process enabled collective ops with (the first
  multi-worker strategy's), or None."""
  return require(context(), "_collective_ops_server_def",
                 "the running collective server")


def keep_running_server(extended):
  """Makes a `CollectiveAllReduceExtended` about to initialize use the
  server this process already runs, as the strategy that started it does:
  TF would otherwise enable collective ops again, which restarts the
  runtime's collectives (the new strategy's first collective then never
  completes on any worker), and would start its health-check thread, whose
  first all-reduce blocks, unbounded, until every worker creates a
  strategy too (the coordination service's heartbeats check health)."""
  # CollectiveAllReduceExtended._initialize_multi_worker starts a server
  # unless the first attribute is set, and turns the check off with the
  # second when the coordination service is configured.
  initialize = require(type(extended), "_initialize_multi_worker",
                       "starting the collective server once per process")
  source = inspect.getsource(initialize)
  for name in ("_std_server_started", "_enable_check_health"):
    if name not in source:
      raise Incompatible(
          f"tfpar needs CollectiveAllReduceExtended._initialize_multi_worker "
          f"to read {name}, which {versions()} does not: update "
          f"tfpar/_compat/runtime.py.")
  extended._std_server_started = True  # pylint: disable=protected-access
  extended._enable_check_health = False  # pylint: disable=protected-access


def configure_coordination_service(cluster_spec, register_timeout_ms,
                                   heartbeat_timeout_ms, use_barrier):
  """Configures TensorFlow's coordination service (once per process) with
  tfpar's connect and heartbeat timeouts.

  Args:
    cluster_spec: the job's `tf.train.ClusterSpec`.
    register_timeout_ms: how long tasks wait for each other to connect.
    heartbeat_timeout_ms: how long a silent peer counts as alive.
    use_barrier: make registration a barrier bounded by the timeout.
  """
  ctx = context()
  if ctx.coordination_service is not None:
    return
  pb2 = coordination_config_pb2()
  ctx.configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(cluster_spec),
      cluster_register_timeout_in_ms=register_timeout_ms,
      heartbeat_timeout_in_ms=heartbeat_timeout_ms,
      coordinated_jobs=[
          pb2.CoordinatedJob(name=job, num_tasks=len(cluster_spec[job]))
          for job in ("chief", "worker") if job in cluster_spec])
  ctx.coordination_service.cluster_register_with_barrier = use_barrier


def dataset_batch_size(dataset):
  """The batch size of a batched `tf.data.Dataset` (looking through
  prefetch, map and the like), or None when it is not known.

  >>> import tensorflow as tf
  >>> dataset_batch_size(tf.data.Dataset.range(10).batch(6).prefetch(1))
  6
  """
  while dataset is not None:
    batch_size = getattr(dataset, "_batch_size", None)
    if batch_size is not None:
      try:
        return int(batch_size.numpy())
      except (AttributeError, TypeError, ValueError):
        return None
    dataset = getattr(dataset, "_input_dataset", None)
  return None


def op_is_stateful(op):
  """Whether a graph op has side effects (kept even without consumers)."""
  return require(op, "_is_stateful", "which ops a step keeps")


def tpu_topology_proto(resolver):
  """The topology proto a `TPUClusterResolver` holds once the TPU system
  was initialized (`set_tpu_topology`), or None."""
  return getattr(resolver, "_tpu_topology", None)
