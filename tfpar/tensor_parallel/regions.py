"""Elementwise regions between column- and row-parallel projections.

Megatron keeps a column-parallel output split until the row-parallel
projection that consumes it, through whatever acts on each feature alone in
between: the activation of `Dense(activation=...)`, but also the
`silu(gate) * up` of a gated MLP written inline in a subclassed layer. A
`Region` is that stretch of a traced TensorFlow graph: the elementwise ops
from the outputs of column projections (its sources) to the input of a row
projection. `find` recognises one; `Region.emit` recomputes it on one shard
of every source, so each device keeps its slice and nothing is gathered.

Anything that is not elementwise on the split axis (a reduction, a reshape)
ends the region: a tensor that is whole along the split axis there makes
`find` return None, and the row projection falls back to scattering its
gathered input, which is exact but moves more bytes.
"""

import dataclasses
import inspect

import tensorflow as tf

# Ops that act on each element alone, with numpy broadcasting.
_ELEMENTWISE = frozenset({
    "Abs", "Acos", "Add", "AddV2", "Asin", "Atan", "Cast", "Ceil", "Cos",
    "Cosh", "Div", "DivNoNan", "Elu", "Erf", "Erfc", "Exp", "Expm1",
    "Floor", "LeakyRelu", "Log", "Log1p", "Maximum", "Minimum", "Mul",
    "MulNoNan", "Neg", "Pow", "RealDiv", "Reciprocal", "Relu", "Relu6",
    "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
    "Softsign", "Sqrt", "Square", "SquaredDifference", "StopGradient",
    "Sub", "Tan", "Tanh", "SelectV2",
})
# Ops that hand their inputs through unchanged (output i is input i).
_PASS_THROUGH = frozenset({"Identity", "IdentityN"})
_LIMIT = 512  # ops; a region longer than this is not an MLP's activation.
# Read by spmd/slice_graph.py (which ops compute each position alone).
ELEMENTWISE_OPS = _ELEMENTWISE
PASS_THROUGH_OPS = _PASS_THROUGH


def key(tensor):
  """A graph tensor's identity: (producing op name, output index)."""
  return (tensor.op.name, tensor.value_index)


@dataclasses.dataclass
class Region:
  """Elementwise ops from split sources to one output tensor.

  Attributes:
    output: the tensor the region computes.
    sources: {tensor key: source} for the split tensors it starts from.
    side: the tensors it also reads, constant along the split axis.
    steps: (op, inputs) in topological order; an input is a tensor key
      (split) or an index into `side`.
  """
  output: object
  sources: dict
  side: list
  steps: list

  def emit(self, shards, side):
    """The region recomputed on shards.

    Args:
      shards: {source key: the source's shard} to start from.
      side: the values to use for `self.side`, in order.

    Returns:
      The shard of the region's output.
    """
    values = dict(shards)
    for op, inputs in self.steps:
      args = [values[x] if isinstance(x, tuple) else side[x] for x in inputs]
      outputs = args if op.type in _PASS_THROUGH else [_emit(op, args)]
      for index, value in enumerate(outputs[:len(op.outputs)]):
        values[(op.name, index)] = value
    return values[key(self.output)]


def _emit(op, args):
  """A new op like `op` (same type and attributes) on `args`."""
  function = getattr(tf.raw_ops, op.type)
  names = [arg.name for arg in op.op_def.input_arg]
  kwargs = dict(zip(names, args))
  for parameter in inspect.signature(function).parameters:
    if parameter not in kwargs and parameter != "name":
      kwargs[parameter] = op.get_attr(parameter)
  return function(**kwargs)


def _broadcasts_along(tensor, axis):
  """Whether `tensor` is constant along `axis` (negative) of the output it
  is broadcast into: too short to reach it, or of size 1 there."""
  rank = tensor.shape.rank
  if rank is None:
    return False
  return rank < -axis or tensor.shape[axis] == 1


def find(tensor, source_of, axis):
  """The elementwise region that computes `tensor` from split sources.

  Args:
    tensor: a symbolic (graph) tensor, e.g. a row projection's input.
    source_of: `source_of(t)` is what `t` is the whole of (a column
      projection's output), or None for other tensors.
    axis: the (negative) axis the sources are split along.

  Returns:
    A `Region`, or None when `tensor` is not such a region (eager tensors,
    ops that are not elementwise, side inputs that vary along `axis`).
  """
  try:
    tensor.op  # pylint: disable=pointless-statement
  except AttributeError:  # An eager tensor: no graph to read.
    return None
  width = tensor.shape[axis] if tensor.shape.rank else None
  sources, side, steps, split = {}, [], [], {}

  def visit(t):
    """True: t is split (depends on a source); False: a side input."""
    t_key = key(t)
    if t_key in split:
      return split[t_key]
    source = source_of(t)
    if source is not None:
      sources[t_key] = source
      split[t_key] = True
      return True
    op = t.op
    if (op.type not in _ELEMENTWISE | _PASS_THROUGH or len(steps) > _LIMIT
        or (op.type not in _PASS_THROUGH and len(op.outputs) != 1)):
      split[t_key] = False
      return False
    kinds = [visit(x) for x in op.inputs]
    through = op.type in _PASS_THROUGH
    if not (kinds[t.value_index] if through else any(kinds)):
      split[t_key] = False
      return False
    if not through:
      if t.shape.rank is None or t.shape[axis] != width:
        raise _NotARegion
      for x, is_split in zip(op.inputs, kinds):
        if not is_split and not _broadcasts_along(x, axis):
          raise _NotARegion
    if not any(step[0] is op for step in steps):
      inputs = []
      for x, is_split in zip(op.inputs, kinds):
        if not is_split:
          side.append(x)
        inputs.append(key(x) if is_split else len(side) - 1)
      steps.append((op, inputs))
    split[t_key] = True
    return True

  try:
    if not visit(tensor) or not sources:
      return None
  except _NotARegion:
    return None
  return Region(tensor, sources, side, steps)


def is_elementwise_function(function):
  """Whether `function(x)` is computed from `x` by elementwise ops only.

  Args:
    function: a function of one float tensor, e.g. a Keras activation.

  Returns:
    True when tracing it on a [batch, 8] placeholder gives a `Region`.
  """
  found = []

  def trace(x):
    y = function(x)
    found.append(find(y, lambda t: x if key(t) == key(x) else None, -1))
    return y

  try:
    tf.function(trace, autograph=False).get_concrete_function(
        tf.TensorSpec((None, 8), tf.float32))
  except (TypeError, ValueError):
    return False
  return found[0] is not None


# Activations that act on each feature alone, so a column-split output can
# be activated shard by shard.
_ELEMENTWISE_ACTIVATIONS = frozenset({
    "linear", "relu", "relu6", "gelu", "silu", "swish", "tanh", "sigmoid",
    "elu", "selu", "softplus", "softsign", "leaky_relu", "mish", "exponential",
    "hard_sigmoid", "hard_silu", "hard_swish", "celu",
})


def is_elementwise(activation):
  """Whether a Keras activation acts on each feature alone: a known Keras
  activation, or a function (keras-hub's `gelu_approximate`) whose traced
  graph holds elementwise ops only (`regions.py`)."""
  if activation is None:
    return True
  if getattr(activation, "__name__", None) in _ELEMENTWISE_ACTIVATIONS:
    return True
  if activation not in _TRACED_ACTIVATIONS:
    _TRACED_ACTIVATIONS[activation] = is_elementwise_function(activation)
  return _TRACED_ACTIVATIONS[activation]


_TRACED_ACTIVATIONS = {}


class _NotARegion(Exception):
  """A split tensor meets something that is not elementwise along it."""
