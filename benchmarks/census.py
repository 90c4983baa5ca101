"""Per-device census of the work in one traced step.

Walks a traced `tf.Graph` (and the bodies of the functions it calls) and
counts, for each device an op is placed on: ops (leaving out constants,
identities, variable reads and other bookkeeping), matmul FLOPs (MatMul,
BatchMatMul and two-operand Einsum: 2 x output elements x contracted
size) and the output elements of every other op (the element-wise work:
LayerNorm, GELU, softmax, residual adds, the loss, the optimizer).

`copied_bytes` counts the other way devices exchange data in a traced
step: every tensor an op reads from another device (a copy TensorFlow
inserts as a Send/Recv pair when it partitions the graph), charged to the
sending device; collectives are not copies (count them when they run).

Used by `bench_tensor_spmd.py` and `bench_expert_tensor_spmd.py`; imports
TensorFlow only when called.
"""

import collections

MATMULS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
           "Einsum", "_MklMatMul"}
SKIP = {"NoOp", "Const", "Identity", "IdentityN", "Placeholder",
        "ReadVariableOp", "VarHandleOp", "_Arg", "_Retval", "StopGradient",
        "Shape", "Reshape"}
KEYS = ("ops", "matmul_flops", "elementwise", "collectives")


def _device(name):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not name:
    return None
  spec = tf.DeviceSpec.from_string(name)
  return f"{spec.device_type}:{spec.device_index}"


def _elements(shape):
  if shape.rank is None or not shape.is_fully_defined():
    return 0
  count = 1
  for size in shape.as_list():
    count *= size
  return count


def _matmul_flops(op):
  if op.type == "Einsum":
    inputs = op.get_attr("equation").decode().split("->")[0].split(",")
    if len(inputs) != 2:
      return 0
    sizes = {}
    for letters, tensor in zip(inputs, op.inputs):
      if tensor.shape.rank is None:
        return 0
      for letter, size in zip(letters, tensor.shape.as_list()):
        if size is not None:
          sizes[letter] = size
    flops = 2
    for size in sizes.values():
      flops *= size
    return flops
  a = op.inputs[0].shape
  if a.rank is None:
    return 0
  transposed = op.get_attr("transpose_a" if op.type in (
      "MatMul", "_MklMatMul") else "adj_x")
  contracted = a.as_list()[-2 if transposed else -1] or 0
  return 2 * _elements(op.outputs[0].shape) * contracted


def census(graph, stats=None, outer_device=None):
  """{device: Counter(ops, matmul_flops, elementwise, collectives)} of the
  ops of `graph` (device None: placed nowhere)."""
  stats = stats if stats is not None else collections.defaultdict(
      collections.Counter)
  for op in graph.get_operations():
    device = _device(op.device) or outer_device
    if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
      body = graph._get_function(op.get_attr("f").name)  # pylint: disable=protected-access
      if body is not None and getattr(body, "graph", None) is not None:
        census(body.graph, stats, device)
        continue
    if op.type in SKIP:
      continue
    stats[device]["ops"] += 1
    if op.type in MATMULS:
      stats[device]["matmul_flops"] += _matmul_flops(op)
    elif op.type.startswith("Collective") or op.type in ("_Send", "_Recv"):
      stats[device]["collectives"] += 1
    else:
      stats[device]["elementwise"] += sum(
          _elements(o.shape) for o in op.outputs if o.dtype.name != "resource")
  return stats


def _bodies(graph, outer_device=None):
  """(graph, op, device) of every op of `graph` and of the functions it
  calls, with the device of the call for ops placed nowhere."""
  for op in graph.get_operations():
    device = _device(op.device) or outer_device
    if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
      body = graph._get_function(op.get_attr("f").name)  # pylint: disable=protected-access
      if body is not None and getattr(body, "graph", None) is not None:
        yield from _bodies(body.graph, device)
        continue
    yield graph, op, device


def _live_ops(graph):
  """The ops of `graph` that run: those the outputs or a stateful op
  need (TensorFlow prunes the rest of a function's graph)."""
  pending = [t.op for t in getattr(graph, "outputs", ())]
  pending += [op for op in graph.get_operations() if op._is_stateful]  # pylint: disable=protected-access
  live = set()
  while pending:
    op = pending.pop()
    if op in live:
      continue
    live.add(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return live


def copied_bytes(graph):
  """{device: bytes of the tensors it sends to ops on other devices} in
  one run of `graph` (each tensor counted once per receiving device; a
  tensor of unknown shape counts 0)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sent = collections.Counter()
  live = {}
  seen = set()
  for body, op, device in _bodies(graph):
    if body not in live:
      live[body] = _live_ops(body)
    if op not in live[body] or device is None:
      continue
    for tensor in op.inputs:
      source = _device(tensor.op.device)
      if (source is None or source == device or
          tensor.dtype in (tf.resource, tf.variant)):
        continue
      key = (tensor.ref(), device)
      if key not in seen:
        seen.add(key)
        sent[source] += _elements(tensor.shape) * tensor.dtype.size
  return sent


def busiest_over_mean(stats, devices, key):
  """How much the busiest of `devices` exceeds their mean, as a fraction."""
  values = [stats[d][key] for d in devices]
  mean = sum(values) / len(values)
  return max(values) / mean - 1 if mean else 0.0


def train_step_graph(model, strategy, dataset):
  """The graph of one `strategy.run(model.train_step)` on a batch of
  `dataset` (forward, backward, gradient all-reduce and optimizer)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

  @tf.function
  def step(data):
    return strategy.run(model.train_step, args=(data,))
  return step.get_concrete_function(batch).graph
