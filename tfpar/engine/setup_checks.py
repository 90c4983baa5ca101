"""Checks `MeshExtended` makes before it sets up, and the collective
server a second multi-worker strategy of a process reuses."""

import tensorflow as tf

from tfpar._compat import runtime


def reuse_running_server(extended, layout):
  """Lets a second multi-worker strategy of this process run on the server
  the first one started (TF would restart the collectives runtime, and the
  new strategy's first collective would never complete on any worker);
  refuses a cluster or task other than the one that server serves."""
  running = runtime.collective_server_def()
  if running is None:
    return
  wanted = tf.train.ClusterSpec(layout.cluster_spec).as_cluster_def()
  if (running.cluster != wanted or running.job_name != layout.task_type or
      running.task_index != layout.task_id):
    was = tf.train.ClusterSpec(running.cluster).as_dict()
    raise ValueError(
        f"This process already runs TensorFlow's collective server as task "
        f"'{running.job_name}:{running.task_index}' of {was}; a strategy for "
        f"task '{layout.task_type}:{layout.task_id}' of "
        f"{layout.cluster_spec} needs another process (TensorFlow serves one "
        f"cluster per process). Keep TF_CONFIG the same for every strategy "
        f"of a process.")
  runtime.keep_running_server(extended)


def check_replicas_inside_workers(mesh):
  """Refuses a multi-worker mesh whose replicas would cross workers."""
  if not mesh.is_multi_worker:
    return
  per_worker = mesh.cluster.devices_per_task
  if per_worker % mesh.replica_size:
    raise ValueError(
        f"Each replica spans pipeline x tensor = {mesh.replica_size} devices "
        f"but each worker has {per_worker}: a replica would cross workers, "
        f"which this strategy does not support. Use pipeline x tensor that "
        f"divides {per_worker} and put the workers on the 'data' axis.")


def check_not_tpu(mesh):
  """Refuses a TPU mesh (tfpar.tpu.tpu_strategy runs those)."""
  # Soft placement would silently run a TPU mesh's "TPU" work on the CPU.
  if mesh.device_assignment is not None:
    raise ValueError(
        f"{mesh!r} is a TPU mesh; tfpar's strategies have not run on TPU "
        f"cores yet. Use tfpar.tpu.tpu_strategy(mesh) for a TPUStrategy with "
        f"the mesh's device assignment (replicas span pipeline x tensor "
        f"logical cores).")
