"""Collectives of a traced step: their kind, size and group, and bus
bandwidth as nccl-tests reports it.

Size is nccl-tests' buffer size per device: the input of an all-reduce,
reduce-scatter or all-to-all, the (whole) output of an all-gather.
algbw = size / time; busbw = algbw x 2 (n - 1) / n for an all-reduce and
algbw x (n - 1) / n for the others (n: devices in the group).
"""

import dataclasses
from typing import Optional

import tensorflow as tf

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "broadcast")

_OP_KINDS = {
    "CollectiveReduceV2": "all-reduce", "CollectiveReduce": "all-reduce",
    "NcclAllReduce": "all-reduce",
    "CollectiveGatherV2": "all-gather", "CollectiveGather": "all-gather",
    "CollectiveReduceScatterV2": "reduce-scatter",
    "CollectiveAllToAllV2": "all-to-all", "CollectiveAllToAllV3": "all-to-all",
    "CollectiveBcastSendV2": "broadcast", "CollectiveBcastSend": "broadcast",
}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of a traced step.

  Attributes:
    kind: one of `KINDS`.
    device: the device that runs it.
    size: nccl-tests' buffer size in bytes (see the module doc), or None
      for a dynamic shape (a sparse gradient's gather).
    group_size: devices in its group, or None when not static.
  """
  kind: str
  device: str
  size: Optional[int]
  group_size: Optional[int]

  @property
  def bus_bytes(self):
    """`size` x the bus factor of its kind and group (None if unknown)."""
    if self.group_size is None or self.size is None:
      return None
    return self.size * bus_factor(self.kind, self.group_size)


def bus_factor(kind, n):
  """busbw / algbw for `kind` on a group of `n` devices (nccl-tests).

  Args:
    kind: one of `KINDS`.
    n: devices in the group.

  Example:

  >>> bus_factor("all-reduce", 4), bus_factor("all-gather", 4)
  (1.5, 0.75)
  """
  if kind == "all-reduce":
    return 2 * (n - 1) / n
  if kind == "broadcast":
    return 1.0
  return (n - 1) / n


def _group_size(op):
  if op.type == "NcclAllReduce":
    return op.get_attr("num_devices")
  if "group_size" in op.node_def.attr:
    return op.get_attr("group_size")
  value = tf.get_static_value(op.inputs[1]) if len(op.inputs) > 1 else None
  return None if value is None else int(value)


def collective_of(op, device):
  """The `Collective` `op` launches on `device`, or None for other ops.

  Args:
    op: a `tf.Operation`.
    device: the device it runs on (its own, or its caller's).

  Returns:
    A `Collective`, or None.
  """
  kind = _OP_KINDS.get(op.type)
  if kind is None:
    return None
  value = op.inputs[0]
  group = _group_size(op)
  size = None
  if value.shape.is_fully_defined():
    size = value.shape.num_elements() * value.dtype.size
    if kind == "all-gather":
      size = None if group is None else size * group
  return Collective(kind, device, size, group)
