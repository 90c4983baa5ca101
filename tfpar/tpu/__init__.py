"""Mapping a `tfpar.Mesh` onto the cores of a TPU slice.

Glossary:
  core: one TensorFlow TPU device (`/device:TPU:k`), a TensorCore.
  chip: the cores that share the same `(x, y, z)` topology coordinates;
    the 4th topology coordinate numbers the cores of a chip.
  host: the cores of one TensorFlow task (a TPU VM / worker).
  logical core: TPUStrategy's index of a core inside a replica
    (`TPUExtended._tpu_devices[replica][logical_core]`).

A replica spans `pipeline x tensor` logical cores and logical core
`stage * tensor + tensor_index` is mesh device `[replica, stage,
tensor_index]`, the same pipeline-major, tensor-minor order as
`Mesh.replica_devices`. The cores are taken in one physical order: host by
host in task order; inside a host chip by chip along a back-and-forth path
through the host's `(x, y, z)` box, so consecutive chips are ICI neighbours;
inside a chip core by core. The mesh consumes that order tensor innermost,
then pipeline, then data, so a tensor group is part of one chip or a run of
neighbouring chips of one host, pipeline stages come next and data replicas
are outermost.

A TPU mesh is single-client: one Python process drives every host of the
slice through TPUStrategy, so `mesh.num_workers` is 1 and the hosts are
`mesh.device_assignment.topology.num_tasks`.
"""

from tfpar.tpu.assignment import core_order
from tfpar.tpu.assignment import device_assignment
from tfpar.tpu.slice_mesh import describe
from tfpar.tpu.slice_mesh import initialize_topology
from tfpar.tpu.slice_mesh import is_tpu_resolver
from tfpar.tpu.slice_mesh import slice_parts
from tfpar.tpu.slice_mesh import tpu_strategy
from tfpar.tpu.slice_mesh import TPULayout

__all__ = ["TPULayout", "core_order", "describe", "device_assignment",
           "initialize_topology", "is_tpu_resolver", "slice_parts",
           "tpu_strategy"]
