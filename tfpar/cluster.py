"""Cluster handling: reading and validating `TF_CONFIG` and cluster resolvers.

Everything here runs before TensorFlow starts a server, so a malformed
cluster fails at once with a `ValueError` that names the setting, its value
and the rule, instead of hanging in a collective later.

The tasks that hold mesh devices are the `chief` (if any) followed by the
`worker`s, in the order `tf.distribute` numbers them
(`multi_worker_util.id_in_cluster`).
"""

import dataclasses
import json
import os
import re

import tensorflow as tf

from tfpar import local_devices
from tfpar._compat import runtime
from tfpar import ports

TF_CONFIG_ENV = "TF_CONFIG"
COMPUTE_JOBS = ("chief", "worker")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[^\s:/\[\]]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
  """Where this process sits in a multi-worker cluster.

  Attributes:
    cluster_spec: `{job: [address, ...]}` as validated.
    task_type: this process's job, `"chief"` or `"worker"`.
    task_id: this process's index within its job.
    tasks: the `(job, index)` pairs that hold mesh devices, in mesh order.
    device_type: `"GPU"`, `"TPU"` or `"CPU"`.
    devices_per_task: how many devices each task contributes.
    rpc_layer: the RPC protocol, usually `"grpc"`.

  Example:

  >>> layout = ClusterLayout({"worker": ["h0:2222", "h1:2222"]}, "worker", 1,
  ...                        (("worker", 0), ("worker", 1)), "GPU", 2)
  >>> layout.task_devices("worker", 1)[1]
  '/job:worker/replica:0/task:1/device:GPU:1'
  """

  cluster_spec: dict
  task_type: str
  task_id: int
  tasks: tuple
  device_type: str
  devices_per_task: int
  rpc_layer: str = "grpc"

  @property
  def num_tasks(self):
    return len(self.tasks)

  @property
  def task_index(self):
    """This process's position in `tasks`."""
    return self.tasks.index((self.task_type, self.task_id))

  @property
  def is_chief(self):
    if "chief" in self.cluster_spec:
      return self.task_type == "chief"
    return self.task_type == "worker" and self.task_id == 0

  def task_devices(self, job, index):
    """Canonical device names of task `(job, index)`."""
    return tuple(
        tf.DeviceSpec(job=job, replica=0, task=index,
                      device_type=self.device_type, device_index=k).to_string()
        for k in range(self.devices_per_task))

  def cluster_resolver(self):
    """A `SimpleClusterResolver` for TF's collective runtime."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(self.cluster_spec),
        task_type=self.task_type, task_id=self.task_id,
        num_accelerators={self.device_type: self.devices_per_task},
        rpc_layer=self.rpc_layer)


def parse_tf_config(text):
  """Parses and validates a `TF_CONFIG` string.

  Args:
    text: the JSON text of `TF_CONFIG`.

  Returns:
    `(cluster_spec, task_type, task_id)`.

  Raises:
    ValueError: malformed JSON, a missing `cluster` or `task`, a task index
      out of range, two chiefs, or an invalid address.

  Example:

  >>> parse_tf_config('{"cluster": {"worker": ["127.0.0.1:2222"]},'
  ...                 ' "task": {"type": "worker", "index": 0}}')
  ({'worker': ['127.0.0.1:2222']}, 'worker', 0)
  """
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
        f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column "
        f"{e.colno}). Received: TF_CONFIG={_clip(text)}") from None
  if not isinstance(config, dict):
    raise ValueError(
        "TF_CONFIG must be a JSON object with 'cluster' and 'task'. "
        f"Received: TF_CONFIG={_clip(text)}")
  for key in ("cluster", "task"):
    if key not in config:
      raise ValueError(
          f"TF_CONFIG has no '{key}' entry; a multi-worker job needs both "
          f"'cluster' and 'task'. Received: TF_CONFIG={_clip(text)}")
  task = config["task"]
  if not isinstance(task, dict) or "type" not in task or "index" not in task:
    raise ValueError(
        "TF_CONFIG 'task' must be an object with 'type' and 'index', e.g. "
        '{"type": "worker", "index": 0}. '
        f"Received: task={json.dumps(task)}")
  cluster = validate_cluster_spec(config["cluster"], task["type"],
                                  task["index"])
  return cluster, task["type"], task["index"]


def validate_cluster_spec(cluster, task_type, task_id):
  """Checks a cluster spec and this process's task within it.

  Args:
    cluster: `{job: [address, ...]}` (or a `tf.train.ClusterSpec`).
    task_type: this process's job name.
    task_id: this process's index within the job.

  Returns:
    The cluster as `{job: [address, ...]}`.

  Raises:
    ValueError: the spec or the task breaks a rule; the message names it.

  Example:

  >>> validate_cluster_spec({"chief": ["h0:1"], "worker": ["h1:1"]},
  ...                       "worker", 0)
  {'chief': ['h0:1'], 'worker': ['h1:1']}
  """
  if isinstance(cluster, tf.train.ClusterSpec):
    cluster = cluster.as_dict()
  if not isinstance(cluster, dict) or not cluster:
    raise ValueError(
        "The cluster must map job names to lists of 'host:port' addresses, "
        'e.g. {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}. '
        f"Received: cluster={cluster!r}")
  normalized, seen = {}, {}
  for job, addresses in cluster.items():
    if isinstance(addresses, dict):  # ClusterSpec allows {index: address}.
      addresses = [addresses[k] for k in sorted(addresses, key=int)]
    if not isinstance(addresses, (list, tuple)) or not addresses:
      raise ValueError(
          f"cluster['{job}'] must be a non-empty list of 'host:port' "
          f"addresses. Received: cluster['{job}']={addresses!r}")
    for index, address in enumerate(addresses):
      if not isinstance(address, str) or not _valid_address(address):
        raise ValueError(
            f"cluster['{job}'][{index}] must be a 'host:port' address with a "
            f"port in 1-65535. Received: {address!r}")
      if address in seen:
        raise ValueError(
            f"Address {address} is used by both {seen[address]} and "
            f"{job}:{index}; every task needs its own port.")
      seen[address] = f"{job}:{index}"
    normalized[job] = list(addresses)
  if len(normalized.get("chief", ())) > 1:
    raise ValueError(
        "There must be at most one 'chief' task. Received: "
        f"cluster['chief']={normalized['chief']!r}")
  if not any(job in normalized for job in COMPUTE_JOBS):
    raise ValueError(
        "The cluster has no 'chief' or 'worker' job, so no task can hold "
        f"mesh devices. Received jobs: {sorted(normalized)}")
  if task_type not in normalized:
    raise ValueError(
        f"Task type {task_type!r} is not a job of the cluster. "
        f"Jobs: {sorted(normalized)}.")
  if isinstance(task_id, bool) or not isinstance(task_id, int):
    raise ValueError(
        f"The task index must be an integer. Received: index={task_id!r}")
  if not 0 <= task_id < len(normalized[task_type]):
    raise ValueError(
        f"Task index {task_id} is out of range for job '{task_type}', which "
        f"has {len(normalized[task_type])} task(s) (valid: 0.."
        f"{len(normalized[task_type]) - 1}).")
  return normalized


def layout_from_resolver(resolver=None):
  """Builds the `ClusterLayout` of this process, or None when it runs alone.

  Args:
    resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
      (`TFConfigClusterResolver`, `SimpleClusterResolver`,
      `SlurmClusterResolver`, `TPUClusterResolver`, ...). Without one,
      `TF_CONFIG` is read if it is set, else the process runs alone.

  Returns:
    A `ClusterLayout`, or None for a single local process.

  Raises:
    ValueError: invalid `TF_CONFIG` or cluster, or a task that holds no
      mesh devices (parameter servers, evaluators).

  Example:

  >>> layout_from_resolver(tf.distribute.cluster_resolver.SimpleClusterResolver(
  ...     tf.train.ClusterSpec({"worker": ["h0:1", "h1:1"]}), task_type="worker",
  ...     task_id=1, num_accelerators={"GPU": 4})).task_index
  1
  """
  if resolver is None or isinstance(
      resolver, tf.distribute.cluster_resolver.TFConfigClusterResolver):
    text = os.environ.get(TF_CONFIG_ENV, "")
    if not text.strip():
      return None
    cluster, task_type, task_id = parse_tf_config(text)
    rpc_layer = json.loads(text).get("rpc_layer") or "grpc"
    device_type, devices_per_task = _local_device_count()
  else:
    cluster = resolver.cluster_spec().as_dict()
    if not cluster:
      return None
    task_type, task_id = resolver.task_type, resolver.task_id
    cluster = validate_cluster_spec(cluster, task_type, task_id)
    rpc_layer = resolver.rpc_layer or "grpc"
    device_type, devices_per_task = _resolver_device_count(resolver)
  if task_type not in COMPUTE_JOBS:
    raise ValueError(
        f"This process is task '{task_type}:{task_id}', but tfpar meshes are "
        f"made of 'chief' and 'worker' tasks only; run tfpar strategies on "
        f"those tasks.")
  if not _server_started():
    ports.check_port_free(cluster[task_type][task_id], f"{task_type}:{task_id}")
  tasks = tuple((job, index) for job in COMPUTE_JOBS
                for index in range(len(cluster.get(job, ()))))
  return ClusterLayout(cluster, task_type, task_id, tasks, device_type,
                       devices_per_task, rpc_layer)


def _server_started():
  # Set by the first MultiWorkerMirroredStrategy of this process, whose
  # server then holds the port; later strategies reuse that server.
  return runtime.server_started()


def _resolver_device_count(resolver):
  try:
    accelerators = resolver.num_accelerators() or {}
  except Exception:  # pylint: disable=broad-except
    accelerators = {}  # Resolvers that must reach a server to count devices.
  for device_type in ("GPU", "TPU"):
    if accelerators.get(device_type, 0) > 0:
      return device_type, int(accelerators[device_type])
  return _local_device_count()


def _local_device_count():
  device_type, names = local_devices.local_accelerators()
  return device_type, len(names)


def _valid_address(address):
  match = _ADDRESS.match(address)
  return bool(match) and 1 <= int(match.group(2)) <= 65535


def _clip(text, limit=200):
  text = repr(text)
  return text if len(text) <= limit else text[:limit] + "..."
