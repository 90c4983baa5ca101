"""Finding a model's attention layers by tracing it.

Scaled dot-product attention leaves the same shape in any traced graph,
whoever wrote the layer: a product of two projections' outputs (queries
and keys), a softmax of it, a product of that with a third projection's
output (values), and a projection consuming the result. `find` reads it
from one symbolic call of the model (`structure.trace_calls`): for each
`Softmax` op it walks back to the score product and from its operands to
the projections that compute them, forward to the weighted-values
product and the output projection. One projection feeding queries, keys
and values is a fused query-key-value kernel (GPT-NeoX).

The head counts come from the graph too: the query heads are the heads
axis of the scores (`[batch, heads, query, key]`), the key/value heads the
query heads times the key projection's width over the query
projection's. The layer computing the attention is the innermost layer
holding its four projections (`Attention.owner`).

What the graph cannot say, `families.py` says (which attributes of the
owner hold the head counts, sublayers adding a per-head bias): the one
place of class-specific knowledge.
"""

import collections
import dataclasses

import keras
import numpy as np

from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import regions
from tfpar.tensor_parallel import score_terms
from tfpar.tensor_parallel import styles

_PRODUCTS = frozenset({"Einsum", "BatchMatMul", "BatchMatMulV2",
                       "BatchMatMulV3", "MatMul"})
_DEPTH = score_terms.DEPTH
_SHAPE_ONLY = score_terms.SHAPE_ONLY


@dataclasses.dataclass
class Attention:
  """One attention computation found in the traced graph.

  Attributes:
    owner: the innermost layer holding the four projections.
    projections: {role: layer} for "query", "key", "value", "output"; a
      fused query-key-value projection is "query" alone.
    query_heads, key_value_heads: the head counts.
    head_dim: features per head.
    head_arguments: ((argument position or name, negative axis), ...) of
      the owner's call arguments that carry a per-head term (a bias over
      all heads, like Falcon's alibi): each device takes its heads.
    problem: why it cannot be split by heads, or None.
    head_local: the owner's sublayers with trainable weights applied to
      the heads (query/key norms): each device's gradient covers its
      heads only, summed over the tensor group.
  """
  owner: object
  projections: dict
  query_heads: int
  key_value_heads: int
  head_dim: int
  head_arguments: tuple = ()
  problem: object = None
  head_local: tuple = ()

  @property
  def fused(self):
    return "key" not in self.projections


def _producers(tensor):
  return list(tensor.op.inputs)


def _walk_back(tensor, stop, depth=_DEPTH):
  """Tensors reached backwards from `tensor` (breadth first), not
  expanding those `stop(t)` accepts; yields (tensor, stopped)."""
  seen, queue = set(), collections.deque([(tensor, 0)])
  while queue:
    t, d = queue.popleft()
    if regions.key(t) in seen:
      continue
    seen.add(regions.key(t))
    stopped = stop(t)
    yield t, stopped
    if not stopped and d < depth and t.op.type not in _SHAPE_ONLY:
      queue.extend((x, d + 1) for x in _producers(t))


def _projections_reached(tensor, outputs):
  """The projection layers whose outputs `tensor` is computed from (walk
  stopped at projection outputs)."""
  found = []
  for t, stopped in _walk_back(tensor, lambda t: regions.key(t) in outputs):
    if stopped and outputs[regions.key(t)] not in found:
      found.append(outputs[regions.key(t)])
  return found


def reads_projections(call, projections, calls):
  """Whether a recorded call's input is computed from the outputs of
  `projections` (recorded in `calls`)."""
  args, kwargs, _ = call
  x = args[0] if args else kwargs.get("inputs")
  outputs = {regions.key(calls[p][2]): p for p in projections if p in calls}
  return hasattr(x, "op") and bool(_projections_reached(x, outputs))


def _score_product(softmax):
  for t, _ in _walk_back(softmax.inputs[0], lambda t: False):
    if t.op.type in _PRODUCTS:
      return t.op
  return None


def _forward(tensor, consumers, accept, depth=_DEPTH):
  """The first op after `tensor` (breadth first) that `accept(op, input
  tensor)` accepts, or None."""
  seen, queue = set(), collections.deque([(tensor, 0)])
  while queue:
    t, d = queue.popleft()
    if regions.key(t) in seen or d > depth:
      continue
    seen.add(regions.key(t))
    for op in consumers.get(regions.key(t), ()):
      if accept(op, t):
        return op, t
      queue.extend((y, d + 1) for y in op.outputs)
  return None, None


def _consumers(graph):
  found = collections.defaultdict(list)
  for op in graph.get_operations():
    for x in op.inputs:
      found[regions.key(x)].append(op)
  return found


def _width(dense):
  """Output features of a Dense / EinsumDense (all output-only axes)."""
  if type(dense) is keras.layers.Dense:
    return int(dense.units)
  _, kernel, output = layouts.einsum_letters(dense.equation)
  inputs = dense.equation.split("->")[0].split(",")[0]
  shape = dense.kernel.shape
  return int(np.prod([shape[i] for i, c in enumerate(kernel)
                      if c in output and c not in inputs]))


def _column_size(dense):
  """Size of the kernel axis a column split cuts."""
  if type(dense) is keras.layers.Dense:
    return int(dense.units)
  letter = layouts.einsum_split_letter(dense.equation, styles.COLUMN)
  if letter is None:
    return None
  _, kernel, _ = layouts.einsum_letters(dense.equation)
  return int(dense.kernel.shape[kernel.index(letter)])


def _heads_axis(scores):
  """The heads axis of scores [batch, heads, query, key] (negative), or
  None when the shape does not say."""
  rank = scores.shape.rank
  if rank is None or rank != 4 or scores.shape[1] is None:
    return None
  return 1 - rank


def _owner(parts, containers):
  """The innermost container holding every projection in `parts`."""
  holding = [(len(inner), layer) for layer, inner in containers.items()
             if all(any(p is x for x in inner) for p in parts)]
  return min(holding, key=lambda item: item[0])[1] if holding else None


def find(calls, projections, containers, head_bias_outputs=()):
  """The attention computations of a traced model.

  Args:
    calls: `structure.trace_calls` records of the projections and the
      containers.
    projections: Dense / EinsumDense layers that may be split.
    containers: {layer: its sublayers} of the layers that may own an
      attention (hold two or more projections).
    head_bias_outputs: keys of tensors computed by sublayers that add a
      per-head bias themselves (`families.HEAD_BIAS_LAYERS`): their side
      input is handled there.

  Returns:
    A list of `Attention`, one per owner.
  """
  outputs, inputs = {}, {}
  for layer in projections:
    if layer in calls and hasattr(calls[layer][2], "op"):
      args, kwargs, output = calls[layer]
      outputs[regions.key(output)] = layer
      x = args[0] if args else kwargs.get("inputs")
      if hasattr(x, "op"):
        inputs.setdefault(regions.key(x), []).append(layer)
  if not outputs:
    return []
  graph = next(iter(calls[l][2] for l in projections if l in calls)).graph
  consumers = _consumers(graph)
  found = {}
  for op in graph.get_operations():
    if op.type != "Softmax":
      continue
    attention = _match(op, outputs, inputs, consumers, containers, calls,
                       set(head_bias_outputs))
    if attention is not None and attention.owner not in found:
      found[attention.owner] = attention
  return list(found.values())


def _match(softmax, outputs, inputs, consumers, containers, calls,
           head_bias_outputs):
  product = _score_product(softmax)
  if product is None or len(product.inputs) != 2:
    return None
  sides = [_projections_reached(x, outputs) for x in product.inputs]
  values_op, from_scores = _forward(
      softmax.outputs[0], consumers, lambda op, t: op.type in _PRODUCTS)
  if values_op is None or any(len(s) != 1 for s in sides):
    return None
  other = [x for x in values_op.inputs
           if regions.key(x) != regions.key(from_scores)]
  value = _projections_reached(other[0], outputs) if other else []
  _, into = _forward(values_op.outputs[0], consumers,
                          lambda op, t: regions.key(t) in inputs)
  if len(value) != 1 or into is None:
    return None
  output = inputs[regions.key(into)][0]
  first, second, value = sides[0][0], sides[1][0], value[0]
  if first is second is value:
    parts = {"query": first, "output": output}
  else:
    # The key projection is as wide as the value projection.
    query, key = ((second, first) if _width(first) == _width(value) and (
        _width(second) != _width(value)) else (first, second))
    parts = {"query": query, "key": key, "value": value, "output": output}
  if len(set(map(id, parts.values()))) != len(parts):
    return None
  owner = _owner(list(parts.values()), containers)
  if owner is None:
    return None
  scores = product.outputs[0]
  axis = _heads_axis(scores)
  attention = Attention(owner, parts, 0, 0, 0)
  if axis is None:
    attention.problem = (f"its attention scores have shape {scores.shape}, "
                         f"not [batch, heads, query, key]")
    return attention
  heads = int(scores.shape[axis])
  attention.query_heads = heads
  query = parts["query"]
  if attention.fused:
    attention.key_value_heads = heads
    attention.head_dim = _width(query) // (3 * heads)
    if _column_size(query) != heads:
      attention.problem = (
          f"its fused query-key-value projection {query.name!r} has no "
          f"kernel axis of one entry per head (a column split would cut "
          f"across queries, keys and values)")
  else:
    attention.head_dim = _width(query) // heads
    attention.key_value_heads = heads * _width(parts["key"]) // _width(query)
  attention.head_arguments, problem = score_terms.per_head_arguments(
      softmax, product, axis, calls.get(owner, ((), {}, None)),
      head_bias_outputs)
  attention.problem = attention.problem or problem
  return attention
