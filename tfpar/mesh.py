"""`tfpar.Mesh`: one validated, immutable grid of devices with named axes.

Glossary:
  axis: a named dimension of the mesh, one of `data`, `pipeline`, `tensor`.
  replica: the devices that share one data-parallel index; a replica spans
    `pipeline x tensor` devices, as a TPU replica spans several cores.
  axis group: the devices that differ only in their index along one axis,
    e.g. a tensor group is the `tensor` devices of one pipeline stage of one
    replica. Collectives of that parallelism run inside such groups.

Devices are ordered with `tensor` innermost, then `pipeline`, then `data`,
so a tensor group is a run of consecutive devices of one worker (its fast
interconnect) and only `data` and `pipeline` cross workers.
"""

import types

import numpy as np

from tfpar import cluster as cluster_lib
from tfpar import local_devices
from tfpar.mesh_axes import AXES
from tfpar.mesh_axes import resolve_sizes
from tfpar.mesh_axes import SizeMismatch
from tfpar.mesh_axes import axis_position
from tfpar.tpu import slice_mesh


class Mesh:
  """An immutable grid of devices with the axes `data`, `pipeline`, `tensor`.

  Args:
    axis_sizes: `{axis: size}`; one size may be -1 to take what the devices
      leave. Axes left out have size 1, except `data`, which is inferred
      when no size is -1. Default: `{"data": -1}`.
    devices: device names in mesh order. Default: every local GPU, else
      every TPU core, else every logical CPU of this host.

  Raises:
    ValueError: an unknown axis, a size that is not a positive integer or
      -1, more than one -1, or sizes whose product is not the device count.

  Example:

  >>> import tfpar
  >>> tfpar.configure_virtual_cpus(4)  # doctest: +SKIP
  >>> mesh = tfpar.Mesh({"data": 2, "tensor": -1})
  >>> mesh.shape
  {'data': 2, 'pipeline': 1, 'tensor': 2}
  >>> mesh.replica_devices(1)
  ('/job:localhost/replica:0/task:0/device:CPU:2',
   '/job:localhost/replica:0/task:0/device:CPU:3')
  """

  __slots__ = ("_shape", "_array", "_cluster", "_tpu")

  def __init__(self, axis_sizes=None, devices=None, *, _cluster=None,
               _tpu=None):
    if devices is None:
      _, devices = local_devices.local_accelerators()
    devices = tuple(devices)
    if not devices:
      raise ValueError("A mesh needs at least one device. Received: devices=()")
    if len(set(devices)) != len(devices):
      raise ValueError(f"Mesh devices must be distinct. Received: {devices}")
    shape = resolve_sizes(axis_sizes, len(devices))
    array = np.empty(len(devices), dtype=object)
    array[:] = devices
    array = array.reshape(tuple(shape.values()))
    array.flags.writeable = False
    object.__setattr__(self, "_shape", types.MappingProxyType(shape))
    object.__setattr__(self, "_array", array)
    object.__setattr__(self, "_cluster", _cluster)
    object.__setattr__(self, "_tpu", _tpu)
    if _cluster is not None:
      self._check_tensor_groups_inside_workers()

  @classmethod
  def from_cluster_resolver(cls, resolver=None, *, topology=None,
                            **axis_sizes):
    """Builds the global mesh of a (possibly multi-worker) cluster.

    Args:
      resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
        (`TFConfigClusterResolver`, `SimpleClusterResolver`,
        `SlurmClusterResolver`, `TPUClusterResolver`). Default: `TF_CONFIG`
        if it is set, else this host alone.
      topology: a TPU `Topology` to use instead of initializing the TPU.
      **axis_sizes: sizes of `data`, `pipeline`, `tensor`, as in `Mesh`.

    Returns:
      A `Mesh` over every device of every `chief`/`worker` task, task by
      task in `tf.distribute` order; on TPU, see `tfpar.tpu`.

    Raises:
      ValueError: a malformed `TF_CONFIG` or cluster, sizes that do not
        multiply to the cluster's device count, or a tensor group that
        would cross workers.

    Example:

    >>> import os, json, tfpar
    >>> os.environ["TF_CONFIG"] = json.dumps({
    ...     "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
    ...     "task": {"type": "worker", "index": 0}})
    >>> mesh = tfpar.Mesh.from_cluster_resolver(data=-1)  # doctest: +SKIP
    """
    if topology is not None or slice_mesh.is_tpu_resolver(resolver):
      shape, devices, layout = slice_mesh.slice_parts(
          resolver, axis_sizes, topology=topology)
      return cls(shape, devices, _tpu=layout)
    layout = cluster_lib.layout_from_resolver(resolver)
    if layout is None:
      return cls(axis_sizes or None)
    devices = [d for job, index in layout.tasks
               for d in layout.task_devices(job, index)]
    try:
      return cls(axis_sizes or None, devices, _cluster=layout)
    except SizeMismatch as e:
      raise ValueError(
          f"{e} The cluster has {layout.num_tasks} task(s) x "
          f"{layout.devices_per_task} {layout.device_type} device(s) = "
          f"{len(devices)} devices.") from None

  def __setattr__(self, name, value):
    raise AttributeError(f"tfpar.Mesh is immutable; cannot set {name!r}.")

  # --- shape -----------------------------------------------------------------
  @property
  def shape(self):
    """`{axis: size}` for `data`, `pipeline`, `tensor`."""
    return dict(self._shape)

  @property
  def size(self):
    return self._array.size

  @property
  def devices(self):
    """All device names, in mesh order."""
    return tuple(self._array.reshape(-1))

  @property
  def device_array(self):
    """A read-only `(data, pipeline, tensor)` array of device names."""
    return self._array

  @property
  def num_replicas(self):
    """The data-parallel degree: the size of the `data` axis."""
    return self._shape["data"]

  @property
  def replica_size(self):
    """Devices per replica: `pipeline x tensor`."""
    return self._shape["pipeline"] * self._shape["tensor"]

  # --- groups ----------------------------------------------------------------
  def replica_devices(self, replica_id):
    """The devices of replica `replica_id`, pipeline-major, tensor-minor."""
    if not 0 <= replica_id < self.num_replicas:
      raise ValueError(
          f"replica_id must be in [0, {self.num_replicas}). "
          f"Received: replica_id={replica_id}")
    return tuple(self._array[replica_id].reshape(-1))

  @property
  def replicas(self):
    """The device group of every replica, in replica order."""
    return tuple(self.replica_devices(r) for r in range(self.num_replicas))

  def axis_groups(self, axis):
    """The groups of devices that differ only along `axis`.

    Args:
      axis: `"data"`, `"pipeline"` or `"tensor"`.

    Returns:
      A tuple of device tuples; each group is ordered by its index on `axis`.
    """
    position = axis_position(axis)
    moved = np.moveaxis(self._array, position, -1)
    return tuple(tuple(g) for g in moved.reshape(-1, self._shape[axis]))

  def coordinates(self, device):
    """`{axis: index}` of `device` in the mesh."""
    found = np.argwhere(self._array == device)
    if not len(found):
      raise ValueError(f"Device {device!r} is not in the mesh.")
    return dict(zip(AXES, (int(i) for i in found[0])))

  # --- cluster ---------------------------------------------------------------
  @property
  def cluster(self):
    """The `ClusterLayout` of a multi-worker mesh, or None."""
    return self._cluster

  @property
  def tpu_layout(self):
    """The TPU slice layout of a mesh made from a TPU resolver, or None."""
    return self._tpu

  @property
  def device_assignment(self):
    """The `tf.tpu.experimental.DeviceAssignment` of a TPU mesh, or None."""
    return None if self._tpu is None else self._tpu.device_assignment

  @property
  def num_workers(self):
    return 1 if self._cluster is None else self._cluster.num_tasks

  @property
  def is_multi_worker(self):
    return self.num_workers > 1

  def worker_of(self, device):
    """Index (in task order) of the worker that holds `device`."""
    if self._cluster is None:
      self.coordinates(device)
      return 0
    return self.devices.index(device) // self._cluster.devices_per_task

  def is_local(self, device):
    """Whether `device` belongs to this process."""
    if self._cluster is None:
      return device in self.devices
    return self.worker_of(device) == self._cluster.task_index

  # --- printing and identity ---------------------------------------------------
  def __repr__(self):
    sizes = ", ".join(f"{a}={n}" for a, n in self._shape.items())
    return f"Mesh({sizes}, devices={self.size}, workers={self.num_workers})"

  def __str__(self):
    lines = [repr(self)]
    for replica_id, group in enumerate(self.replicas):
      lines.append(f"  replica {replica_id}:")
      for device in group:
        c = self.coordinates(device)
        lines.append(f"    pipeline {c['pipeline']} tensor {c['tensor']}  "
                     f"{device}")
    return "\n".join(lines)

  def __eq__(self, other):
    return (isinstance(other, Mesh) and self.shape == other.shape
            and self.devices == other.devices)

  def __hash__(self):
    return hash((tuple(self._shape.items()), self.devices))

  def _check_tensor_groups_inside_workers(self):
    per_worker = self._cluster.devices_per_task
    tensor = self._shape["tensor"]
    if per_worker % tensor:
      fits = [n for n in range(1, per_worker + 1) if per_worker % n == 0]
      raise ValueError(
          f"tensor={tensor} would put a tensor group across workers: each "
          f"worker has {per_worker} device(s) and tensor groups must stay "
          f"inside one worker's fast interconnect. Use a tensor size that "
          f"divides {per_worker} (one of {fits}) and move the rest to "
          f"'pipeline' or 'data'.")
