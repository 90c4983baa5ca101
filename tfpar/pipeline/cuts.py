"""Where a Functional model can be cut into pipeline stages, and which cuts
balance the stages.

A *cut* before node i of the model's layer order is the set of tensors that
the nodes before it computed (or the model's inputs) and the nodes from i
on still use: its *crossing set*. A stage that starts at a cut takes the
crossing set as its inputs and returns the crossing set of its end cut
(tensors it does not use are passed through unchanged).

A cut is valid when at most one crossing tensor carries the activations:
every other crossing tensor is a model input (keras-hub's integer padding
mask, used by every block) or is computed from model inputs by layers
without weights (a mask built once). So a residual block is never split:
its skip connection and its branch would both cross.
"""

import math
import warnings

import keras
import numpy as np

from tfpar._compat import keras_layers


ordered_nodes = keras_layers.ordered_nodes

# A plan whose most expensive stage costs more than this many times the
# mean stage warns: the other devices idle most of each step.
IMBALANCE_WARNING = 1.5


def _input_derived(graph, nodes):
  """ids of the model inputs and of the tensors computed from them alone by
  layers without weights."""
  derived = {id(t) for t in keras.tree.flatten(graph.inputs)}
  for node in nodes:
    if getattr(node.operation, "weights", None):
      continue
    if all(id(t) in derived for t in node.input_tensors):
      derived.update(id(t) for t in node.outputs)
  return derived


def crossings(graph, nodes):
  """The crossing set before every node index where the model can be cut.

  Args:
    graph: the Functional graph (`functional_graph(model)`).
    nodes: `ordered_nodes(graph)`.

  Returns:
    {i: tuple of KerasTensors} for every valid cut 0 < i < len(nodes), the
    tensors in the order they were computed (model inputs first).

  Example:

  >>> import keras
  >>> from tfpar.pipeline import cuts
  >>> ids = keras.Input((4,), dtype="int32", name="ids")
  >>> mask = keras.Input((4, 1), name="mask")
  >>> x = keras.layers.Embedding(8, 2, name="embed")(ids)
  >>> x = keras.layers.Dense(2, name="dense")(x)
  >>> y = keras.layers.Multiply(name="masked")([x, mask])
  >>> model = keras.Model({"ids": ids, "mask": mask}, y)
  >>> nodes = cuts.ordered_nodes(model)
  >>> before_dense = cuts.crossings(model, nodes)[1]  # mask and embeddings.
  >>> len(before_dense), before_dense[0].name
  (2, 'mask')
  """
  inputs = keras.tree.flatten(graph.inputs)
  last_use = {}
  for i, node in enumerate(nodes):
    for tensor in node.input_tensors:
      last_use[id(tensor)] = i
  for tensor in keras.tree.flatten(graph.outputs):
    last_use[id(tensor)] = len(nodes)
  derived = _input_derived(graph, nodes)
  live = {id(t): t for t in inputs}
  found = {}
  for i, node in enumerate(nodes[:-1]):
    for tensor in node.outputs:
      live[id(tensor)] = tensor
    live = {key: t for key, t in live.items() if last_use.get(key, -1) > i}
    if sum(key not in derived for key in live) <= 1:
      found[i + 1] = tuple(live.values())
  return found


def cut_points(graph, nodes):
  """The cuts where exactly one tensor crosses and no model input is used
  after the cut (what the planner estimates stages from).

  Returns:
    {i: the crossing tensor}.
  """
  inputs = {id(t) for t in keras.tree.flatten(graph.inputs)}
  return {i: crossing[0] for i, crossing in crossings(graph, nodes).items()
          if len(crossing) == 1 and id(crossing[0]) not in inputs}


def elements(tensor):
  """Elements per sample of a tensor (unknown dimensions count as 1)."""
  return int(np.prod([d or 1 for d in tensor.shape[1:]]))


def crossing_bytes(crossing):
  """Bytes per sample the tensors of a cut send forward (float ones send
  as many back as gradients)."""
  total = 0
  for tensor in crossing:
    size = np.dtype(keras.backend.standardize_dtype(tensor.dtype)).itemsize
    floating = "float" in keras.backend.standardize_dtype(tensor.dtype)
    total += elements(tensor) * size * (2 if floating else 1)
  return total


def balanced_cuts(costs, candidates, num_stages, transfer=None):
  """Cut indices (len num_stages - 1) minimizing the largest stage cost.

  Args:
    costs: the cost of every node.
    candidates: the node indices a stage may start at.
    num_stages: the pipeline size.
    transfer: optional {candidate: cost of moving its crossing set}, added
      to the stages on both sides of a cut (so of two equally balanced
      cuts, the one that moves fewer bytes wins).

  Returns:
    The sorted start indices of stages 1 .. num_stages - 1.
  """
  transfer = transfer or {}
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  points = [0] + sorted(candidates) + [len(costs)]
  moved = [transfer.get(point, 0.0) for point in points]
  moved[0] = moved[-1] = 0.0
  # best[k][j]: minimal max-cost splitting nodes[:points[j]] into k stages.
  best = [[math.inf] * len(points) for _ in range(num_stages + 1)]
  choice = [[None] * len(points) for _ in range(num_stages + 1)]
  best[0][0] = 0.0
  for k in range(1, num_stages + 1):
    for j in range(1, len(points)):
      for i in range(j):
        if best[k - 1][i] == math.inf:
          continue
        stage = prefix[points[j]] - prefix[points[i]] + moved[i] + moved[j]
        value = max(best[k - 1][i], stage)
        if value < best[k][j]:
          best[k][j], choice[k][j] = value, i
  cuts, j = [], len(points) - 1
  for k in range(num_stages, 0, -1):
    j = choice[k][j]
    cuts.append(points[j])
  return sorted(cuts)[1:]


def named_cuts(model, layers, cuts, names, num_stages):
  """The start indices of the stages `names` (layer names) start.

  Args:
    model: the model cut (for messages).
    layers: the layer of every node (`ordered_nodes`).
    cuts: `crossings(graph, nodes)`.
    names: the layers starting stages 1 .. num_stages - 1.
    num_stages: the pipeline size.

  Raises:
    ValueError: a wrong count of names, a name that is not a layer of the
      (inlined) graph or not a cut point, names out of order.
  """
  names = list(names) if not isinstance(names, str) else [names]
  if len(names) != num_stages - 1:
    raise ValueError(
        f"stages must name the first layer of each stage after the first: "
        f"{num_stages - 1} names for {num_stages} stages. Received: "
        f"stages={names!r}")
  index = {}
  for i, layer in enumerate(layers):
    index.setdefault(layer.name, i)  # A shared layer: its first call.
  starts = []
  for name in names:
    if name not in index:
      raise ValueError(
          f"stages names layer {name!r}, which model {model.name!r} does "
          f"not have. Its layers: {', '.join(index)}.")
    if index[name] not in cuts:
      valid = ", ".join(layers[i].name for i in sorted(cuts)) or "none"
      raise ValueError(
          f"Model {model.name!r} cannot be cut before layer {name!r}: more "
          f"than one tensor of activations crosses there (a skip connection "
          f"or a branch). Layers a stage can start at: {valid}.")
    starts.append(index[name])
  if starts != sorted(set(starts)):
    raise ValueError(f"stages must name distinct layers in model order. "
                     f"Received: stages={names!r}")
  return starts


def warn_imbalance(plan, stage_nodes, cost_of):
  """Warns when the most expensive stage costs more than
  `IMBALANCE_WARNING` times the mean, naming it and its costliest layer.

  Args:
    plan: the `StagePlan`.
    stage_nodes: the graph nodes of every stage.
    cost_of: `cost_of(layer, node)`, the cost of one node.
  """
  if len(plan) < 2 or plan.imbalance <= IMBALANCE_WARNING:
    return
  total = sum(s.cost for s in plan.stages)
  stage = max(plan.stages, key=lambda s: s.cost)
  costs = {}
  for node in stage_nodes[stage.index]:
    key = id(node.operation)
    cost = costs.get(key, (node.operation, 0.0))[1]
    costs[key] = (node.operation, cost + cost_of(node.operation, node))
  layer, cost = max(costs.values(), key=lambda pair: pair[1])
  warnings.warn(
      f"Pipeline stages of model {plan.model.name!r} are unbalanced: stage "
      f"{stage.index} of {len(plan)} holds {stage.cost / total:.0%} of the "
      f"estimated cost, where an even split gives {1 / len(plan):.0%} "
      f"(max / mean cost {plan.imbalance:.2f}, more than "
      f"{IMBALANCE_WARNING}). Its layer {layer.name!r} "
      f"({type(layer).__name__}) alone holds {cost / total:.0%}, and a "
      f"stage starts only between layers (never inside a residual block), "
      f"so the other stages' devices wait for this one most of each step. "
      f"Split that layer into smaller ones, use a smaller 'pipeline' axis, "
      f"or check the cut with strategy.describe_stages(model).",
      stacklevel=3)
