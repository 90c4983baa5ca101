"""Which TPU cores a `data x pipeline x tensor` mesh takes, and in what order.

The cores are taken in one physical order: host by host in task order;
inside a host chip by chip along a back-and-forth path through the host's
`(x, y, z)` box, so consecutive chips are ICI neighbours; inside a chip core
by core. The mesh consumes that order tensor innermost, then pipeline, then
data, so a tensor group is part of one chip or a run of neighbouring chips
of one host, pipeline stages come next and data replicas are outermost.
"""

import numpy as np
import tensorflow as tf

from tfpar import mesh_axes


def core_order(topology):
  """The physical order in which a mesh takes the cores of `topology`.

  Args:
    topology: a `tf.tpu.experimental.Topology` or its serialized bytes.

  Returns:
    An int array `[num_cores, 4]` of `(x, y, z, core)` coordinates: host by
    host in task order, chips of a host along a back-and-forth path
    (x fastest, then y, then z), cores of a chip in core order.

  Example:

  >>> topology = tf.tpu.experimental.Topology(
  ...     mesh_shape=[2, 1, 1, 2], device_coordinates=[[
  ...         [1, 0, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 1]]])
  >>> core_order(topology).tolist()
  [[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]]
  """
  topology = as_topology(topology)
  order = []
  for cores in topology.device_coordinates:  # One host (task) at a time.
    chips = cores[:, :3] - cores[:, :3].min(axis=0)
    extent = chips.max(axis=0) + 1
    keys = [_path_key(chip, extent) + (int(core[3]),)
            for chip, core in zip(chips, cores)]
    order.extend(cores[i] for i in sorted(range(len(cores)),
                                          key=keys.__getitem__))
  return np.array(order, dtype=np.int32)


def device_assignment(topology, data=-1, pipeline=1, tensor=1):
  """Maps a `data x pipeline x tensor` mesh onto the cores of a TPU slice.

  Args:
    topology: a `tf.tpu.experimental.Topology` (what
      `tf.tpu.experimental.initialize_tpu_system` returns) or its
      serialized bytes.
    data: replicas; -1 takes what the other sizes leave.
    pipeline: pipeline stages per replica.
    tensor: tensor-parallel cores per stage; a tensor group is part of one
      chip or whole neighbouring chips of one host.

  Returns:
    A `tf.tpu.experimental.DeviceAssignment` with `num_replicas = data` and
    `num_cores_per_replica = pipeline x tensor`; logical core
    `stage * tensor + tensor_index` of replica `r` is mesh device
    `[r, stage, tensor_index]`.

  Raises:
    ValueError: sizes that are not positive integers (or -1), whose product
      is not the slice's core count, or a `tensor` size that would split a
      chip or put a tensor group across hosts.

  Example:

  >>> topology = tf.tpu.experimental.Topology(
  ...     mesh_shape=[2, 1, 1, 2], device_coordinates=[[
  ...         [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]]])
  >>> assignment = device_assignment(topology, data=2, tensor=2)
  >>> assignment.num_replicas, assignment.num_cores_per_replica
  (2, 2)
  >>> assignment.core_assignment[1].tolist()  # Replica 1: chip (1, 0, 0).
  [[1, 0, 0, 0], [1, 0, 0, 1]]
  """
  topology = as_topology(topology)
  shape = mesh_shape(topology, {"data": data, "pipeline": pipeline,
                                 "tensor": tensor})
  order = core_order(topology)
  return tf.tpu.experimental.DeviceAssignment(
      topology, order.reshape(shape["data"], -1, topology.mesh_rank))


def mesh_shape(topology, axis_sizes):
  """The mesh's `{axis: size}` on a slice, with the tensor groups checked.

  Args:
    topology: a `tf.tpu.experimental.Topology`.
    axis_sizes: `{axis: size}` as in `tfpar.Mesh` (one size may be -1), or
      None for `{"data": -1}`.

  Raises:
    ValueError: sizes whose product is not the slice's core count, or a
      `tensor` size that would split a chip or cross hosts.

  Example:

  >>> topology = tf.tpu.experimental.Topology(
  ...     mesh_shape=[1, 1, 1, 2], device_coordinates=[[[0, 0, 0, 0],
  ...                                                   [0, 0, 0, 1]]])
  >>> mesh_shape(topology, {"tensor": 2})
  {'data': 1, 'pipeline': 1, 'tensor': 2}
  """
  hosts, per_host = topology.num_tasks, topology.num_tpus_per_task
  per_chip = int(topology.mesh_shape[-1])
  try:
    shape = mesh_axes.resolve_sizes(axis_sizes, hosts * per_host)
  except mesh_axes.SizeMismatch as e:
    raise ValueError(
        f"{e} The TPU slice has {hosts} host(s) x {per_host} core(s) = "
        f"{hosts * per_host} cores (mesh_shape="
        f"{topology.mesh_shape.tolist()}).") from None
  tensor = shape["tensor"]
  if per_host % tensor or (per_chip % tensor and tensor % per_chip):
    fits = [n for n in range(1, per_host + 1) if per_host % n == 0 and (
        per_chip % n == 0 or n % per_chip == 0)]
    raise ValueError(
        f"tensor={tensor} cannot keep every tensor group inside one TPU "
        f"host: each host has {per_host} core(s), {per_chip} per chip, and a "
        f"tensor group must be part of one chip or whole chips of one host. "
        f"Use a tensor size in {fits} and move the rest to 'pipeline' or "
        f"'data'.")
  return shape


def _path_key(chip, extent):
  """Sort key of a back-and-forth path through a box: x fastest, then y, z."""
  x, y, z = (int(c) for c in chip)
  nx, ny, _ = (int(n) for n in extent)
  y_step = y if z % 2 == 0 else ny - 1 - y
  row = z * ny + y_step
  return (z, y_step, x if row % 2 == 0 else nx - 1 - x)


def as_topology(topology):
  """`topology` as a `tf.tpu.experimental.Topology` (it may be serialized).

  Args:
    topology: a `Topology` or its serialized bytes.

  Raises:
    ValueError: anything else.

  Example:

  >>> topology = tf.tpu.experimental.Topology(
  ...     mesh_shape=[1, 1, 1, 1], device_coordinates=[[[0, 0, 0, 0]]])
  >>> as_topology(topology.serialized()).num_tasks
  1
  """
  if isinstance(topology, bytes):
    return tf.tpu.experimental.Topology(serialized=topology)
  if not isinstance(topology, tf.tpu.experimental.Topology):
    raise ValueError(
        "topology must be a tf.tpu.experimental.Topology or its serialized "
        f"bytes. Received: topology={topology!r}")
  return topology
