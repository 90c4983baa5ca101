"""A `tfpar.Mesh` over the cores of a TPU slice, TF's `TPUStrategy` over
the same cores, and a table of where every mesh device sits."""

import dataclasses

import numpy as np
import tensorflow as tf

from tfpar._compat import runtime
from tfpar.tpu import assignment as assignment_lib


@dataclasses.dataclass(frozen=True)
class TPULayout:
  """What a TPU mesh keeps about its slice.

  Attributes:
    resolver: the `TPUClusterResolver` the mesh was built from, or None.
    topology: the slice's `tf.tpu.experimental.Topology`.
    device_assignment: the `tf.tpu.experimental.DeviceAssignment` with
      `num_replicas = data` and `num_cores_per_replica = pipeline x tensor`.
    job: the job name of the TPU device names, e.g. `"worker"`.
  """

  resolver: object
  topology: object
  device_assignment: object
  job: str


def is_tpu_resolver(resolver):
  """Whether `resolver` is a `TPUClusterResolver`.

  Args:
    resolver: any object.

  Example:

  >>> resolvers = tf.distribute.cluster_resolver
  >>> is_tpu_resolver(resolvers.TPUClusterResolver("local"))
  True
  """
  return isinstance(resolver,
                    tf.distribute.cluster_resolver.TPUClusterResolver)


def initialize_topology(resolver=None):
  """The topology of the slice behind `resolver`, initializing it if needed.

  Reuses the topology a resolver holds once
  `tf.tpu.experimental.initialize_tpu_system(resolver)` (or
  `TPUClusterResolver.connect`) ran, because initializing again frees every
  TPU buffer; otherwise connects to the cluster (remote TPUs) and
  initializes the TPU system. Needs TPU hardware.

  Args:
    resolver: a `TPUClusterResolver`; None means the local TPU.

  Returns:
    A `tf.tpu.experimental.Topology`.

  Raises:
    tf.errors.NotFoundError: no TPU is reachable (TensorFlow's error).

  Example:

  >>> resolver = tf.distribute.cluster_resolver.TPUClusterResolver("local")
  >>> initialize_topology(resolver)  # doctest: +SKIP
  <...Topology object at ...>
  """
  # Set by the public `set_tpu_topology`, which initialize_tpu_system calls.
  proto = runtime.tpu_topology_proto(resolver)
  if proto is not None and proto.device_coordinates:
    return tf.tpu.experimental.Topology(serialized=proto.SerializeToString())
  if resolver is not None and resolver.master():
    tf.config.experimental_connect_to_cluster(resolver)
  return tf.tpu.experimental.initialize_tpu_system(resolver)


def slice_parts(resolver=None, axis_sizes=None, *, topology=None, job=None):
  """What a `tfpar.Mesh` over the TPU cores of a slice is made of:
  `(shape, devices, TPULayout)`. `tfpar.Mesh.from_cluster_resolver` builds
  the mesh from them for a `TPUClusterResolver` or a `topology`.

  Args:
    resolver: a `TPUClusterResolver`, or None for the local TPU.
    axis_sizes: `{axis: size}` as in `tfpar.Mesh`; default `{"data": -1}`.
    topology: the slice's `tf.tpu.experimental.Topology`; default
      `initialize_topology(resolver)`, which needs TPU hardware. Pass one to
      plan or test a layout without a TPU.
    job: the job of the TPU device names; default `"localhost"` for a TPU
      attached to this VM, else the resolver's job (`"worker"`).

  Returns:
    The mesh's `{axis: size}`, its devices (the assignment's TPU cores in
    mesh order) and its `TPULayout` (which holds the `DeviceAssignment`).

  Raises:
    ValueError: as `device_assignment`.
    tf.errors.NotFoundError: no `topology` and no TPU is reachable.

  Example:

  >>> topology = tf.tpu.experimental.Topology(
  ...     mesh_shape=[1, 1, 1, 2], device_coordinates=[[[0, 0, 0, 0],
  ...                                                   [0, 0, 0, 1]]])
  >>> shape, devices, layout = slice_parts(None, {"tensor": 2},
  ...                                      topology=topology)
  >>> devices
  ['/job:localhost/replica:0/task:0/device:TPU:0', '/job:localhost/replica:0/task:0/device:TPU:1']
  """
  if topology is None:
    topology = initialize_topology(resolver)
  topology = assignment_lib.as_topology(topology)
  shape = assignment_lib.mesh_shape(topology, axis_sizes or None)
  assignment = assignment_lib.device_assignment(topology, **shape)
  if job is None:
    remote = resolver is not None and resolver.master()
    job = resolver.get_job_name() if remote else "localhost"
  devices = [_canonical(assignment.tpu_device(r, k, job))
             for r in range(assignment.num_replicas)
             for k in range(assignment.num_cores_per_replica)]
  return shape, devices, TPULayout(resolver, topology, assignment, job)


def tpu_strategy(mesh, resolver=None):
  """TF's `TPUStrategy` over the same cores, in the same order, as `mesh`.

  Its `extended._tpu_devices[r][k]` is `mesh.replica_devices(r)[k]` and
  `experimental_logical_device(k)` selects the mesh column `k`.

  Args:
    mesh: a TPU mesh from `Mesh.from_cluster_resolver(TPUClusterResolver)`.
    resolver: the resolver to give TPUStrategy; default the mesh's.

  Returns:
    `tf.distribute.TPUStrategy(resolver,
    experimental_device_assignment=mesh.device_assignment)`.

  Raises:
    ValueError: `mesh` has no device assignment.

  Example:

  >>> resolver = tf.distribute.cluster_resolver.TPUClusterResolver("local")
  >>> tf.config.experimental_connect_to_cluster(resolver)  # doctest: +SKIP
  >>> mesh = tfpar.Mesh.from_cluster_resolver(  # doctest: +SKIP
  ...     resolver, tensor=2)
  >>> strategy = tpu_strategy(mesh)  # doctest: +SKIP
  """
  layout = mesh.tpu_layout
  if layout is None:
    raise ValueError(
        "tpu_strategy needs a TPU mesh, built by tfpar.Mesh."
        "from_cluster_resolver(TPUClusterResolver(...)). Received: "
        f"mesh={mesh!r} with devices {mesh.devices[:2]}...")
  return tf.distribute.TPUStrategy(
      resolver if resolver is not None else layout.resolver,
      experimental_device_assignment=layout.device_assignment)


def describe(mesh):
  """A table of where every mesh device sits on the TPU slice.

  Args:
    mesh: a TPU mesh.

  Returns:
    The mesh, the slice, then one line per core: replica, logical core,
    pipeline and tensor index, host (task), TPU ordinal, chip `(x, y, z)`
    and core. The device name is `/job:<job>/replica:0/task:<task>/
    device:TPU:<ordinal>`.

  Raises:
    ValueError: `mesh` has no device assignment.

  Example:

  >>> topology = tf.tpu.experimental.Topology(
  ...     mesh_shape=[1, 1, 1, 2], device_coordinates=[[[0, 0, 0, 0],
  ...                                                   [0, 0, 0, 1]]])
  >>> import tfpar
  >>> print(describe(tfpar.Mesh.from_cluster_resolver(topology=topology,
  ...                                                 tensor=2)))
  Mesh(data=1, pipeline=1, tensor=2, devices=2, workers=1)
  TPU mesh_shape=[1, 1, 1, 2]: 1 host(s) x 2 core(s), job 'localhost'
    replica 0 core 0 (pipeline 0 tensor 0)  task 0 TPU:0  chip (0, 0, 0) core 0
    replica 0 core 1 (pipeline 0 tensor 1)  task 0 TPU:1  chip (0, 0, 0) core 1
  """
  assignment = mesh.device_assignment
  if assignment is None:
    raise ValueError(f"describe needs a TPU mesh. Received: mesh={mesh!r}")
  topology, tensor = assignment.topology, mesh.shape["tensor"]
  job = mesh.tpu_layout.job
  lines = [repr(mesh),
           f"TPU mesh_shape={topology.mesh_shape.tolist()}: "
           f"{topology.num_tasks} host(s) x {topology.num_tpus_per_task} "
           f"core(s), job {job!r}"]
  for r, k in np.ndindex(assignment.num_replicas,
                         assignment.num_cores_per_replica):
    x, y, z, core = (int(c) for c in assignment.coordinates(r, k))
    task = topology.task_ordinal_at_coordinates((x, y, z, core))
    lines.append(
        f"  replica {r} core {k} (pipeline {k // tensor} tensor {k % tensor})"
        f"  task {task} TPU:{assignment.tpu_ordinal(r, k)}  chip {(x, y, z)} "
        f"core {core}")
  return "\n".join(lines)


def _canonical(name):
  return tf.DeviceSpec.from_string(name).make_merged_spec(
      tf.DeviceSpec(replica=0)).to_string()
