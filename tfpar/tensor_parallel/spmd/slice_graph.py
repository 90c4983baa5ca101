"""Which traced tensors are sequence slices: those a trace computed from
marked slices position by position.

Inside keras-hub's blocks the residual adds, casts and normalizations are
plain TensorFlow ops, not nodes of the model's graph, so sequence
parallelism cannot mark their outputs as it marks a node's. A tensor is a
slice when its op acts on each position alone (elementwise ops with numpy
broadcasting, bias adds, identities, reductions over feature axes) and its inputs
are slices or constant along the sequence (a weight, an epsilon, a
[batch, position, 1] statistic of a slice), at least one a slice. A
reduction over the sequence, a reshape or a gather ends the walk: its
output is not a slice.
"""

import tensorflow as tf

from tfpar.tensor_parallel import regions

AXIS = 1  # [batch, sequence, ...]
_ELEMENTWISE = regions.ELEMENTWISE_OPS
_PASS_THROUGH = regions.PASS_THROUGH_OPS
_REDUCTIONS = frozenset({"Mean", "Sum", "Max", "Min", "Prod"})
_LIMIT = 256  # ops walked per query; a longer chain is not a block's.


def _constant_along_sequence(x, rank):
  """Whether `x`, broadcast into an output of `rank`, is constant along
  the sequence axis (too short to reach it, or of size 1 there)."""
  if x.shape.rank is None:
    return False
  position = AXIS - (rank - x.shape.rank)
  return position < 0 or x.shape[position] == 1


def _inputs(op, value_index):
  """The inputs of `op` that its output `value_index` is computed from
  position by position, or None if it mixes positions."""
  if op.type in _PASS_THROUGH:
    return [op.inputs[value_index]]
  if op.type in _REDUCTIONS:
    source = op.inputs[0]
    axes = tf.get_static_value(op.inputs[1])
    if axes is None or source.shape.rank is None:
      return None
    axes = [int(a) % source.shape.rank for a in tf.nest.flatten(
        axes.tolist())]
    if any(a <= AXIS for a in axes):
      return None
    return [source]
  if op.type == "BiasAdd":  # Keras's add of a 1-D bias (features last).
    return list(op.inputs) if op.get_attr("data_format") == b"NHWC" else (
        None)
  if op.type in _ELEMENTWISE and len(op.outputs) == 1:
    return list(op.inputs)
  return None


def is_slice(x, marked, cache):
  """Whether graph tensor `x` is a sequence slice.

  Args:
    x: a symbolic tensor of a trace.
    marked: {ref: tensor} of tensors known to be slices.
    cache: {ref: bool} of answers so far (updated).

  Returns:
    True if `x` is marked or computed position by position from marked
    tensors (see the module's docstring).
  """
  budget = [_LIMIT]

  def visit(t):
    ref = t.ref()
    if ref in marked:
      return True
    if ref in cache:
      return cache[ref]
    cache[ref] = False  # Until shown otherwise (also breaks cycles).
    rank = t.shape.rank
    if rank is None or rank <= AXIS or budget[0] <= 0:
      return False
    budget[0] -= 1
    inputs = _inputs(t.op, t.value_index)
    if not inputs:
      return False
    found = False
    for source in inputs:
      if visit(source):
        found = True
      elif not _constant_along_sequence(source, rank):
        return False
    cache[ref] = found
    return found

  try:
    x.op  # pylint: disable=pointless-statement
  except AttributeError:  # Eager or symbolic Keras tensors: no graph.
    return False
  return visit(x)
