"""Per-device census of the work in one traced step.

Walks a traced `tf.Graph` (and the bodies of the functions it calls) and
counts, for each device an op is placed on: ops (leaving out constants,
identities, variable reads and other bookkeeping), matmul FLOPs (MatMul,
BatchMatMul and two-operand Einsum: 2 x output elements x contracted
size) and the output elements of every other op (the element-wise work:
LayerNorm, GELU, softmax, residual adds, the loss, the optimizer).

Used by `bench_tensor_spmd.py`; imports TensorFlow only when called.
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
