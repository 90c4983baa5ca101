"""Cutting a Keras model into pipeline stages.

A `Sequential` model, or a Functional model that is a chain of blocks, has
*cut points*: places in its layer order where exactly one tensor connects
everything before to everything after (a residual block is one block: its
skip connection crosses no cut inside it). Stage `s` is the sub-model from
cut `s` to cut `s + 1`; its layers, their variables and optimizer slots go
on the stage's device.

Costs are estimated per layer as its multiply-adds per sample (parameters
times the positions they are applied at) plus its output size, and
`stages="auto"` picks the cuts that minimize the most expensive stage.
"""

import dataclasses
import math

import keras
import numpy as np


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage.

  Attributes:
    index: its position in the pipeline.
    layers: its Keras layers, in order.
    cost: its estimated cost (multiply-adds per sample plus outputs).
    num_params: its parameter count.
    model: the Keras sub-model computing it.
  """
  index: int
  layers: tuple
  cost: float
  num_params: int
  model: keras.Model = dataclasses.field(repr=False, compare=False)

  @property
  def variables(self):
    """Its variables (trainable and not), each once."""
    seen, found = set(), []
    for layer in self.layers:
      for variable in getattr(layer, "weights", ()):
        if id(variable) not in seen:
          seen.add(id(variable))
          found.append(variable)
    return found


class StagePlan:
  """The stages a model is cut into.

  Args:
    model: the cut model.
    stages: the `Stage`s, in pipeline order.
  """

  def __init__(self, model, stages):
    self.model = model
    self.stages = tuple(stages)

  def __len__(self):
    return len(self.stages)

  def describe(self, devices=None):
    """A table of the stages: layers, cost share, parameters, device.

    Args:
      devices: optional device name per stage.
    """
    total = sum(s.cost for s in self.stages) or 1.0
    rows = [("stage", "layers", "first .. last", "cost", "params", "device")]
    for stage in self.stages:
      rows.append((
          str(stage.index), str(len(stage.layers)),
          f"{stage.layers[0].name} .. {stage.layers[-1].name}",
          f"{100 * stage.cost / total:.1f}%", f"{stage.num_params:,}",
          devices[stage.index] if devices else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"Pipeline stages of {self.model.name!r}: "
             f"{len(self.stages)} stages, balance (max / mean cost) "
             f"{self.imbalance:.2f}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
              for r in rows]
    return "\n".join(lines)

  @property
  def imbalance(self):
    """Most expensive stage over the mean stage cost (1.0 is perfect)."""
    costs = [s.cost for s in self.stages]
    return max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0


def functional_graph(model):
  """The Functional graph of a Sequential or Functional model, or raises."""
  if isinstance(model, keras.Sequential):
    graph = getattr(model, "_functional", None)
    if graph is None:
      raise ValueError(
          f"Sequential model {model.name!r} has no known input shape, so it "
          f"cannot be cut into pipeline stages. Start it with keras.Input.")
    return graph
  if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth"):
    return model
  raise ValueError(
      f"Model {model.name!r} ({type(model).__name__}) is not a chain of "
      f"layers: PipelineParallelStrategy cuts Sequential models and "
      f"Functional models whose blocks follow one another. A subclassed "
      f"model's call() cannot be cut.")


def _ordered_nodes(graph):
  nodes = []
  for depth in sorted(graph._nodes_by_depth, reverse=True):  # pylint: disable=protected-access
    nodes.extend(n for n in graph._nodes_by_depth[depth]  # pylint: disable=protected-access
                 if not n.is_input)
  return nodes


def cut_points(graph, nodes):
  """The cut tensor before each node index, where one exists.

  Returns:
    {i: tensor} for every 0 < i < len(nodes) such that `tensor` is the only
    value computed by nodes[:i] that nodes[i:] or the outputs use, and no
    model input is used by nodes[i:].
  """
  outputs = {id(t) for t in keras.tree.flatten(graph.outputs)}
  inputs = {id(t) for t in keras.tree.flatten(graph.inputs)}
  last_use = {}
  for i, node in enumerate(nodes):
    for tensor in node.input_tensors:
      last_use[id(tensor)] = i
  for tensor_id in outputs:
    last_use[tensor_id] = len(nodes)
  live = {t: last_use.get(t, -1) for t in inputs}
  tensors = {}
  cuts = {}
  for i, node in enumerate(nodes[:-1]):
    for tensor in node.outputs:
      live[id(tensor)] = last_use.get(id(tensor), -1)
      tensors[id(tensor)] = tensor
    crossing = [t for t, last in live.items() if last > i]
    if len(crossing) == 1 and crossing[0] in tensors:
      cuts[i + 1] = tensors[crossing[0]]
  return cuts


def _num_params(layer):
  # Keras ops in a Functional graph (x + y, ops.*) are not layers.
  return sum(int(np.prod(w.shape)) for w in getattr(layer, "weights", ()))


def _layer_cost(layer, node):
  out_elements = sum(int(np.prod([d or 1 for d in t.shape[1:]]))
                     for t in node.outputs)
  params = _num_params(layer)
  last = node.outputs[0].shape
  positions = int(np.prod([d or 1 for d in last[1:-1]])) if len(last) > 2 else 1
  return params * positions + out_elements


def _balanced_cuts(costs, candidates, num_stages):
  """Cut indices (len num_stages - 1) minimizing the largest stage cost."""
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  points = [0] + sorted(candidates) + [len(costs)]
  # best[k][j]: minimal max-cost splitting nodes[:points[j]] into k stages.
  best = [[math.inf] * len(points) for _ in range(num_stages + 1)]
  choice = [[None] * len(points) for _ in range(num_stages + 1)]
  best[0][0] = 0.0
  for k in range(1, num_stages + 1):
    for j in range(1, len(points)):
      for i in range(j):
        if best[k - 1][i] == math.inf:
          continue
        value = max(best[k - 1][i], prefix[points[j]] - prefix[points[i]])
        if value < best[k][j]:
          best[k][j], choice[k][j] = value, i
  cuts, j = [], len(points) - 1
  for k in range(num_stages, 0, -1):
    j = choice[k][j]
    cuts.append(points[j])
  return sorted(cuts)[1:]


def plan_stages(model, num_stages, stages="auto"):
  """Cuts `model` into `num_stages` stages.

  Args:
    model: a built Sequential or Functional Keras model.
    num_stages: the pipeline size.
    stages: `"auto"` to balance estimated costs, or the names of the layers
      that start stages 1 .. num_stages - 1.

  Returns:
    A `StagePlan`.

  Raises:
    ValueError: the model is not a chain, has fewer layers than stages, a
      cut name does not exist or is not a cut point.

  Example:

  >>> import keras
  >>> from tfpar.pipeline.stages import plan_stages
  >>> model = keras.Sequential([keras.Input((4,))] + [
  ...     keras.layers.Dense(4, name=f"d{i}") for i in range(4)])
  >>> [s.layers[0].name for s in plan_stages(model, 2).stages]
  ['d0', 'd2']
  """
  graph = functional_graph(model)
  nodes = _ordered_nodes(graph)
  if len(nodes) < num_stages:
    raise ValueError(
        f"Model {model.name!r} has {len(nodes)} layers, fewer than the "
        f"{num_stages} pipeline stages: each stage needs at least one layer. "
        f"Use a smaller 'pipeline' axis.")
  layers = [n.operation for n in nodes]
  if len({id(l) for l in layers}) != len(layers):
    raise ValueError(
        f"Model {model.name!r} calls a layer more than once (shared "
        f"layers), so it cannot be cut into pipeline stages.")
  cuts = cut_points(graph, nodes)
  if stages == "auto":
    if len(cuts) < num_stages - 1:
      raise ValueError(
          f"Model {model.name!r} is not a chain of {num_stages} blocks: it "
          f"has {len(cuts)} places where a single tensor joins the layers "
          f"before to the layers after, and {num_stages} stages need "
          f"{num_stages - 1}.")
    costs = [_layer_cost(l, n) for l, n in zip(layers, nodes)]
    starts = _balanced_cuts(costs, cuts, num_stages)
  else:
    starts = _named_cuts(model, layers, cuts, stages, num_stages)
  return _build_plan(model, graph, nodes, layers, cuts, starts)


def _named_cuts(model, layers, cuts, names, num_stages):
  names = list(names) if not isinstance(names, str) else [names]
  if len(names) != num_stages - 1:
    raise ValueError(
        f"stages must name the first layer of each stage after the first: "
        f"{num_stages - 1} names for {num_stages} stages. Received: "
        f"stages={names!r}")
  index = {l.name: i for i, l in enumerate(layers)}
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
          f"than one tensor crosses there (a skip connection or a branch). "
          f"Layers a stage can start at: {valid}.")
    starts.append(index[name])
  if starts != sorted(set(starts)):
    raise ValueError(f"stages must name distinct layers in model order. "
                     f"Received: stages={names!r}")
  return starts


def _build_plan(model, graph, nodes, layers, cuts, starts):
  bounds = [0] + list(starts) + [len(nodes)]
  boundary = [graph.input] + [cuts[i] for i in starts] + [graph.output]
  stages = []
  for s in range(len(bounds) - 1):
    stage_layers = tuple(layers[bounds[s]:bounds[s + 1]])
    cost = sum(_layer_cost(l, n) for l, n in
               zip(stage_layers, nodes[bounds[s]:bounds[s + 1]]))
    params = sum(_num_params(l) for l in stage_layers)
    sub_model = keras.Model(boundary[s], boundary[s + 1],
                            name=f"{model.name}_stage{s}")
    stages.append(Stage(s, stage_layers, float(cost), params, sub_model))
  return StagePlan(model, stages)
