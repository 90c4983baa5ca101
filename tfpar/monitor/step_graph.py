"""What one traced training step does: its FLOPs per device and its
collectives, read from the step's graph (and the functions it calls).

A `tf.cond` counts as its heavier branch (by FLOPs, then bytes): under
gradient accumulation the update and its all-reduce run one step in N, so
the step that applies it is what is counted. A loop body counts once.
"""

import collections
import dataclasses
from typing import Dict, List

import tensorflow as tf

from tfpar._compat import graph_functions
from tfpar.monitor import bandwidth
from tfpar.monitor import flops as flops_lib

_BRANCHING = ("If", "StatelessIf", "Case", "StatelessCase")


@dataclasses.dataclass
class StepCount:
  """FLOPs and collectives of one traced step, per device.

  Attributes:
    flops: {device: FLOPs of its matrix products}.
    dtypes: {dtype name: FLOPs done in it}.
    collectives: the `bandwidth.Collective`s, one per op and device.
    loops: whether some op sat in a loop body (counted once).
  """
  flops: Dict[str, int] = dataclasses.field(default_factory=dict)
  dtypes: Dict[str, int] = dataclasses.field(default_factory=dict)
  collectives: List[bandwidth.Collective] = dataclasses.field(
      default_factory=list)
  loops: bool = False

  @property
  def total_flops(self):
    return sum(self.flops.values())

  def add(self, other):
    for device, value in other.flops.items():
      self.flops[device] = self.flops.get(device, 0) + value
    for dtype, value in other.dtypes.items():
      self.dtypes[dtype] = self.dtypes.get(dtype, 0) + value
    self.collectives.extend(other.collectives)
    self.loops = self.loops or other.loops

  def bytes_by_kind(self):
    """{kind: (size, bus bytes)} of the busiest device per kind; (None,
    None) for a kind with a collective of dynamic shape."""
    per_device = collections.defaultdict(lambda: [0, 0])
    for c in self.collectives:
      entry = per_device[(c.kind, c.device)]
      entry[0] = None if entry[0] is None or c.size is None else (
          entry[0] + c.size)
      entry[1] = None if entry[1] is None or c.bus_bytes is None else (
          entry[1] + c.bus_bytes)
    totals = {}
    for (kind, _), (size, bus) in per_device.items():
      if size is None or totals.get(kind, (0,))[0] is None:
        totals[kind] = (None, None)
      elif kind not in totals or size > totals[kind][0]:
        totals[kind] = (size, bus)
    return totals


def canonical_device(name):
  """A device name in full form (`/job:.../device:CPU:0`), or "" if none.

  Example:

  >>> canonical_device("/device:CPU:1")
  '/device:CPU:1'
  """
  return tf.DeviceSpec.from_string(name).to_string() if name else ""


def _weight(count):
  return (count.total_flops, sum(c.size or 0 for c in count.collectives))


def count_graph(graph, device="", in_loop=False):
  """The `StepCount` of `graph`'s ops and of the functions they call.

  Args:
    graph: a `tf.Graph` (a traced step's FuncGraph).
    device: the device of ops that name none (their caller's).
    in_loop: whether `graph` is a loop's body.

  Returns:
    A `StepCount`.

  Raises:
    flops.UnknownShape: a matrix product has a dynamic shape.

  Example:

  >>> import tensorflow as tf
  >>> @tf.function
  ... def step(x, w):
  ...   return tf.cond(tf.reduce_sum(x) > 0, lambda: x @ w, lambda: x)
  >>> graph = step.get_concrete_function(
  ...     tf.TensorSpec((2, 3)), tf.TensorSpec((3, 3))).graph
  >>> count_graph(graph).total_flops  # the heavier branch: 2 x 2 x 3 x 3
  36
  """
  count = StepCount(loops=in_loop)
  for op in graph.get_operations():
    where = canonical_device(op.device) or device
    value = flops_lib.op_flops(op)
    if value:
      count.flops[where] = count.flops.get(where, 0) + value
      dtype = op.outputs[0].dtype.name
      count.dtypes[dtype] = count.dtypes.get(dtype, 0) + value
    collective = bandwidth.collective_of(op, where)
    if collective is not None:
      count.collectives.append(collective)
    called = graph_functions.called_graphs(op)
    if not called:
      continue
    parts = [count_graph(g, where, in_loop or repeats)
             for g, repeats in called]
    if op.type in _BRANCHING:
      count.add(max(parts, key=_weight))
    else:
      for part in parts:
        count.add(part)
  return count
