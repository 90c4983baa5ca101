"""Terms added to attention scores per head, found in a traced graph.

Splitting attention by heads runs the layer's call on each device's
heads. A term added to the scores with one entry per head (an alibi
bias) must then be each device's heads' part: `per_head_arguments` finds
such terms between the score product and the softmax, and says which
call argument carries each (each device takes its heads of it,
`spmd/head_terms.py`) or why none does (a term computed inside the layer
for all heads: the attention cannot be split by heads unless a sublayer
of `families.HEAD_BIAS_LAYERS` computes it).
"""

from tfpar.tensor_parallel import regions

DEPTH = 64  # ops walked from a softmax before giving up.
# Ops whose output does not depend on their input's values (rotary tables
# sized from the query's shape): walks do not pass them.
SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike",
                        "OnesLike"})
# Ops through which a per-head side input is still a call argument.
_THROUGH = frozenset({"Identity", "Cast"})
# Elementwise ops: of inputs equal across heads, a result equal across
# heads (a mask broadcast to the scores' shape, as Keras's
# dot_product_attention builds it from ones_like(scores)).
_ELEMENTWISE = regions.ELEMENTWISE_OPS | regions.PASS_THROUGH_OPS | {
    "LogicalAnd", "LogicalOr", "LogicalNot", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual"}


def _same_for_every_head(tensor, axis, depth=0):
  """Whether `tensor` is computed, by elementwise ops, from tensors of size
  1 along the heads `axis` (or too short to reach it) and from shape-only
  ops (ones or zeros like the scores): equal for every head."""
  rank = tensor.shape.rank
  if rank is not None and (rank < -axis or tensor.shape[axis] == 1):
    return True
  op = tensor.op
  if op.type in SHAPE_ONLY or (op.type == "Fill" and
                               op.inputs[1].shape.rank == 0):
    return True  # Sized like the scores, one value (Keras's masks).
  if op.type not in _ELEMENTWISE or depth > DEPTH or not op.inputs:
    return False
  return all(_same_for_every_head(x, axis, depth + 1) for x in op.inputs)


def _side_inputs(softmax, product):
  """(op, side tensor) of ops on the way from the scores product to the
  softmax, for inputs that do not come from the product."""
  found, on_path = [], {}

  def reaches(t, d=0):
    k = regions.key(t)
    if k not in on_path:
      on_path[k] = t.op is product or (
          d < DEPTH and t.op.type not in SHAPE_ONLY and any(
          [reaches(x, d + 1) for x in t.op.inputs]))
    return on_path[k]

  reaches(softmax.inputs[0])
  for k, is_on in list(on_path.items()):
    if not is_on:
      continue
    op = softmax.graph.get_operation_by_name(k[0])
    if op is product:
      continue
    found.extend((op, x) for x in op.inputs if not on_path.get(
        regions.key(x), False))
  return found


def _argument_of(tensor, call):
  """(position or name) of `tensor` among a recorded call's arguments."""
  args, kwargs, _ = call
  while True:
    for i, a in enumerate(args):
      if hasattr(a, "op") and regions.key(a) == regions.key(tensor):
        return i
    for name, a in kwargs.items():
      if hasattr(a, "op") and regions.key(a) == regions.key(tensor):
        return name
    if tensor.op.type not in _THROUGH:
      return None
    tensor = tensor.op.inputs[0]


def per_head_arguments(softmax, product, axis, owner_call,
                       head_bias_outputs):
  """(head arguments, problem) of an attention's per-head score terms.

  Args:
    softmax: the `Softmax` op.
    product: the score product op before it.
    axis: the scores' heads axis (negative).
    owner_call: the owner layer's recorded (args, kwargs, output).
    head_bias_outputs: keys of outputs of `HEAD_BIAS_LAYERS` sublayers
      (their terms are handled there).

  Returns:
    ((argument position or name, negative axis), ...), and None or why
    the layer cannot be split by heads.
  """
  arguments = []
  for op, side in _side_inputs(softmax, product):
    rank = side.shape.rank
    if rank is None or rank < -axis or side.shape[axis] in (None, 1):
      continue
    if any(regions.key(y) in head_bias_outputs for y in op.outputs) or (
        _same_for_every_head(side, axis)):
      continue
    where = _argument_of(side, owner_call)
    if where is None:
      return (), (
          f"its scores get a per-head term ({side.op.type} {side.name}, "
          f"shape {side.shape}) computed inside the layer for all heads")
    # Broadcast aligns trailing axes: the same negative axis.
    arguments.append((where, axis))
  return tuple(arguments), None
