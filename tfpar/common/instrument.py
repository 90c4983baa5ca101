"""`CommunicationLog`: counts the tensor-group communication tfpar emits.

Every communication op tfpar's tensor-parallel layers put into a step (the
forward pass and, through their custom gradients, the backward pass) is
recorded when it is created: once per trace inside `tf.function` (each
execution of the traced step runs each recorded op once), once per call
eagerly. A gather whose result nothing in the traced step consumes is
pruned by TensorFlow before it runs and is left out of the counts.
"""

import collections
import dataclasses
import threading
from typing import Optional

import tensorflow as tf

from tfpar._compat import runtime

_lock = threading.Lock()
_active = []  # Open logs; replica threads share them.

FORWARD = "forward"
BACKWARD = "backward"


@dataclasses.dataclass
class Record:
  """One communication op.

  Attributes:
    kind: "reduce" (sum of the shards' partial results onto the replica's
      head device), "broadcast" (head to every shard device), "gather"
      (shards concatenated onto the head), "scatter" (head split to the
      shards), and with sequence parallelism "reduce-scatter" (partial
      results summed, each device keeping a slice of the sequence) and
      "all-gather" (sequence slices concatenated on every device).
    phase: "forward" or "backward".
    bytes: bytes moved between devices, or None if a shape is not static.
    layer: the layer that emitted it.
    replica: the replica id, or None outside a replica context.
    graph: the `tf.Graph` it was traced into, or None when eager.
    tensor: its result (to tell pruned gathers apart).
  """
  kind: str
  phase: str
  bytes: Optional[int]
  layer: str
  replica: Optional[int]
  graph: object
  tensor: object = dataclasses.field(repr=False, default=None)


def _replica_id():
  context = tf.distribute.get_replica_context()
  if context is None or not tf.distribute.has_strategy():
    return None
  return tf.get_static_value(context.replica_id_in_sync_group)


def moved_bytes(tensor, copies):
  """Bytes of `copies` copies of `tensor`, or None for a dynamic shape."""
  if not tensor.shape.is_fully_defined():
    return None
  return int(tensor.shape.num_elements() * tensor.dtype.size * copies)


def record(kind, phase, nbytes, layer, tensor=None):
  """Adds a record to every open `CommunicationLog`."""
  if not _active:
    return
  graph = None
  if not tf.executing_eagerly():
    graph = tf.compat.v1.get_default_graph()
    # Ops in a tf.cond branch belong to the step that contains the cond.
    while getattr(graph, "is_control_flow_graph", False):
      graph = graph.outer_graph
  entry = Record(kind, phase, nbytes, layer, _replica_id(), graph, tensor)
  with _lock:
    for log in _active:
      log.records.append(entry)


def _is_live(tensor, graph_outputs, memo):
  """Whether a traced tensor feeds the graph's outputs or a stateful op."""
  key = id(tensor)
  if key in memo:
    return memo[key]
  memo[key] = False
  live = any(tensor is out for out in graph_outputs)
  for op in tensor.consumers():
    if live:
      break
    live = runtime.op_is_stateful(op) or any(
        _is_live(o, graph_outputs, memo) for o in op.outputs)
  memo[key] = live
  return live


class CommunicationLog:
  """Context manager recording the communication of tensor-parallel layers.

  Example:

  >>> import tfpar
  >>> with tfpar.CommunicationLog() as log:
  ...   pass  # model.fit(...) for one step
  >>> log.counts()
  {}
  """

  def __init__(self):
    self.records = []

  def __enter__(self):
    with _lock:
      _active.append(self)
    return self

  def __exit__(self, *exc_info):
    with _lock:
      _active.remove(self)

  def step_records(self, replica=0):
    """The records of the last traced step of `replica` (or of the eager
    calls when nothing was traced), without pruned gathers."""
    mine = [r for r in self.records if r.replica == replica]
    graphs = [r.graph for r in mine if r.graph is not None]
    if graphs:
      graph = graphs[-1]
      mine = [r for r in mine if r.graph is graph]
      outputs = list(getattr(graph, "outputs", ()))
      memo = {}
      mine = [r for r in mine if r.kind != "gather" or r.phase != FORWARD or
              _is_live(r.tensor, outputs, memo)]
    return mine

  def counts(self, replica=0):
    """{(kind, phase): number of ops} in one step of `replica`."""
    return dict(collections.Counter(
        (r.kind, r.phase) for r in self.step_records(replica)))

  def bytes(self, replica=0):
    """{(kind, phase): bytes moved} in one step of `replica`.

    Raises:
      ValueError: a recorded tensor had a dynamic shape (feed batches of a
        fixed size, e.g. `dataset.batch(n, drop_remainder=True)`).
    """
    totals = collections.Counter()
    for r in self.step_records(replica):
      if r.bytes is None:
        raise ValueError(
            f"A {r.kind} in layer {r.layer!r} has a dynamic shape, so its "
            f"bytes are unknown. Use fixed-size batches "
            f"(drop_remainder=True) to count bytes.")
      totals[(r.kind, r.phase)] += r.bytes
    return dict(totals)
