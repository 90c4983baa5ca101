"""Pipelines whose stages sit on different `TF_CONFIG` workers.

The chief drives the whole pipeline, as one client: it connects to the
cluster (`tf.config.experimental_connect_to_cluster`) and places the
stages that belong to other workers on their remote devices; TF moves
activations and gradients between workers over gRPC. The other workers
only serve their devices: their `PipelineParallelStrategy(...)` starts
their TF server and returns nothing, ending the process once the chief's
server is gone (the convention of `ParameterServerStrategy`'s workers).
"""

import os
import socket
import sys
import time

import tensorflow as tf

from tfpar import mesh as mesh_lib

_POLL_SECONDS = 0.5
_CHIEF_START_SECONDS = 600


def crosses_workers(mesh):
  """Whether some replica's devices are on more than one worker."""
  if not mesh.is_multi_worker:
    return False
  return any(len({mesh.worker_of(d) for d in group}) > 1
             for group in mesh.replicas)


def driver_mesh(mesh):
  """Connects the chief to the cluster and returns the mesh it drives.

  On other workers: serves this worker's devices until the chief is gone,
  then exits the process.

  Args:
    mesh: a multi-worker mesh whose pipelines cross workers.

  Raises:
    ValueError: the mesh also has a `data` axis.
  """
  if mesh.shape["data"] != 1:
    raise ValueError(
        f"A pipeline whose stages sit on different workers runs with "
        f"data=1; this mesh has data={mesh.shape['data']}. Put whole "
        f"pipelines on each worker to add a data axis (pipeline x tensor "
        f"dividing the devices per worker).")
  layout = mesh.cluster
  spec = tf.train.ClusterSpec(layout.cluster_spec)
  if not layout.is_chief:
    _serve_until_chief_exits(layout, spec)
  tf.config.experimental_connect_to_cluster(
      spec, job_name=layout.task_type, task_index=layout.task_id)
  return mesh_lib.Mesh(dict(mesh.shape), mesh.devices)


def _serve_until_chief_exits(layout, spec):
  config = tf.compat.v1.ConfigProto(
      device_count={layout.device_type: layout.devices_per_task})
  server = tf.distribute.Server(spec, job_name=layout.task_type,
                                task_index=layout.task_id, config=config)
  del server  # Serves from its own threads until the process ends.
  chief_job = "chief" if "chief" in layout.cluster_spec else "worker"
  host, port = layout.cluster_spec[chief_job][0].rsplit(":", 1)
  seen = False
  deadline = time.monotonic() + _CHIEF_START_SECONDS
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=2):
        seen = True
    except OSError:
      if seen:
        break
      if time.monotonic() > deadline:
        sys.exit(f"The chief at {host}:{port} did not start within "
                 f"{_CHIEF_START_SECONDS} s.")
    time.sleep(_POLL_SECONDS)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access  # TF servers never stop.
