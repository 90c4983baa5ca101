"""Cutting a Keras model into pipeline stages.

A `Sequential` model, or a Functional model that is a chain of blocks, has
*cuts* (`tfpar.pipeline.cuts`): places in its layer order where one tensor
carries the activations from everything before to everything after, maybe
with model inputs (keras-hub's padding mask) or masks computed from them
alongside. A residual block is one block: its skip connection crosses no
cut inside it. Stage `s` is the sub-model from cut `s` to cut `s + 1`: it
takes the crossing set of its start cut and returns the crossing set of
its end cut. Its layers, their variables and optimizer slots go on the
stage's device.

A nested Functional model called as one layer (a keras-hub task calling
its backbone) is inlined first (`tfpar._compat.keras_graph`): its own
layers' calls join the outer graph, so stages start and end inside it and
`stages=[...]` names its layers. A plan whose most expensive stage costs
over `cuts.IMBALANCE_WARNING` times the mean warns, naming the stage, its
share and its costliest layer.

A layer called by several stages (a tied embedding: keras-hub's
`ReversibleEmbedding` embeds the tokens in the first stage and computes
the logits in the last) belongs to the first stage that calls it: its
variables live there, later stages read them across devices, and the
executor sums the gradients of every stage that uses them.

Costs are estimated per layer as its multiply-adds per sample (parameters
times the positions they are applied at) plus its output size, and
`stages="auto"` picks the cuts that minimize the most expensive stage,
counting the elements each cut moves (forward and back) against the
stages on both sides of it.
"""

import dataclasses

import keras
import numpy as np

from tfpar._compat import keras_graph
from tfpar._compat import keras_layers
from tfpar.common import whole_weights
from tfpar.pipeline import cuts as cuts_lib

# Re-exported for the planner, which estimates stages as plan_stages cuts.
cut_points = cuts_lib.cut_points
_ordered_nodes = cuts_lib.ordered_nodes
balanced_cuts = cuts_lib.balanced_cuts


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage.

  Attributes:
    index: its position in the pipeline.
    layers: the Keras layers it calls, in order, each once.
    cost: its estimated cost (multiply-adds per sample plus outputs).
    num_params: the parameter count of the layers it owns.
    model: the Keras sub-model computing it.
    shared: the layers it calls that an earlier stage owns (their
      variables live on that stage's devices).
  """
  index: int
  layers: tuple
  cost: float
  num_params: int
  model: keras.Model = dataclasses.field(repr=False, compare=False)
  shared: tuple = ()

  @property
  def variables(self):
    """The variables (trainable and not) of the layers it owns, each once."""
    shared = {id(l) for l in self.shared}
    seen, found = set(), []
    for layer in self.layers:
      if id(layer) in shared:
        continue
      # The variables held (tensor shards, local experts), not the whole
      # weights `layer.weights` lists once a strategy has split them.
      held = (whole_weights.held(layer)
              if isinstance(layer, keras.layers.Layer) else ())
      for variable in held:
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
          f"{stage.layers[0].name} .. {stage.layers[-1].name}" + (
              f" (shares {', '.join(l.name for l in stage.shared)})"
              if stage.shared else ""),
          f"{100 * stage.cost / total:.1f}%", f"{stage.num_params:,}",
          devices[stage.index] if devices else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"Pipeline stages of {self.model.name!r}: "
             f"{len(self.stages)} stages, balance (max / mean cost) "
             f"{self.imbalance:.2f}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
              for r in rows]
    return "\n".join(lines)

  def stage_of_layers(self):
    """{id(layer): index of the stage that owns it}, for every layer and
    sub-layer a stage owns (not the ones it shares from an earlier
    stage)."""
    found = {}
    for stage in self.stages:
      shared = {id(l) for l in stage.shared}
      for layer in stage.layers:
        if isinstance(layer, keras.layers.Layer) and id(layer) not in shared:
          for sub in keras_layers.flatten_layers(layer, include_self=True):
            found.setdefault(id(sub), stage.index)
    return found

  @property
  def imbalance(self):
    """Most expensive stage over the mean stage cost (1.0 is perfect)."""
    costs = [s.cost for s in self.stages]
    return max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0


def functional_graph(model):
  """The Functional graph of a Sequential or Functional model, or raises."""
  graph = keras_layers.functional_graph(model)
  if isinstance(model, keras.Sequential):
    if graph is None:
      raise ValueError(
          f"Sequential model {model.name!r} has no known input shape, so it "
          f"cannot be cut into pipeline stages. Start it with keras.Input.")
    return graph
  if isinstance(model, keras.Model) and graph is model:
    return model
  raise ValueError(
      f"Model {model.name!r} ({type(model).__name__}) is not a chain of "
      f"layers: PipelineParallelStrategy cuts Sequential models and "
      f"Functional models whose blocks follow one another. A subclassed "
      f"model's call() cannot be cut.")


def _num_params(layer):
  # Keras ops in a Functional graph (x + y, ops.*) are not layers.
  return sum(int(np.prod(w.shape)) for w in getattr(layer, "weights", ()))


def layer_cost(layer, node):
  out_elements = sum(int(np.prod([d or 1 for d in t.shape[1:]]))
                     for t in node.outputs)
  params = _num_params(layer)
  last = node.outputs[0].shape
  positions = int(np.prod([d or 1 for d in last[1:-1]])) if len(last) > 2 else 1
  return params * positions + out_elements


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
  # Nested Functional models (a keras-hub task's backbone) are inlined:
  # stages may start and end inside them.
  graph, _ = keras_graph.inlined(functional_graph(model),
                                 f"{model.name}_inlined")
  nodes = cuts_lib.ordered_nodes(graph)
  if len(nodes) < num_stages:
    raise ValueError(
        f"Model {model.name!r} has {len(nodes)} layers, fewer than the "
        f"{num_stages} pipeline stages: each stage needs at least one layer. "
        f"Use a smaller 'pipeline' axis.")
  layers = [n.operation for n in nodes]
  cuts = cuts_lib.crossings(graph, nodes)
  if stages == "auto":
    if len(cuts) < num_stages - 1:
      raise ValueError(
          f"Model {model.name!r} is not a chain of {num_stages} blocks: it "
          f"has {len(cuts)} places where a single tensor (with model inputs "
          f"such as a padding mask) joins the layers before to the layers "
          f"after, and {num_stages} stages need {num_stages - 1}.")
    costs = [layer_cost(l, n) for l, n in zip(layers, nodes)]
    # Elements moved, in float32 units: comparable with the costs.
    transfer = {i: cuts_lib.crossing_bytes(c) / 4 for i, c in cuts.items()}
    starts = cuts_lib.balanced_cuts(costs, cuts, num_stages, transfer)
  else:
    starts = cuts_lib.named_cuts(model, layers, cuts, stages, num_stages)
  return _build_plan(model, graph, nodes, layers, cuts, starts)


def _unique(items):
  seen, found = set(), []
  for item in items:
    if id(item) not in seen:
      seen.add(id(item))
      found.append(item)
  return tuple(found)


def _passed_through(inputs, outputs, name):
  """`outputs`, with an Identity on those that are also `inputs`: Keras
  clones a sub-model's inputs when some are not `keras.Input`s (they are
  another stage's outputs), and an output that is an input would then be
  disconnected from the clones."""
  ids = {id(t) for t in inputs}
  return [keras.layers.Identity(name=f"{name}_passes_{i}")(t)
          if id(t) in ids else t for i, t in enumerate(outputs)]


def _build_plan(model, graph, nodes, layers, cuts, starts):
  bounds = [0] + list(starts) + [len(nodes)]
  boundary = ([graph.input] + [list(cuts[i]) for i in starts] +
              [graph.output])
  owner = {}
  stages = []
  for s in range(len(bounds) - 1):
    stage_nodes = nodes[bounds[s]:bounds[s + 1]]
    stage_layers = _unique(layers[bounds[s]:bounds[s + 1]])
    shared = tuple(l for l in stage_layers if id(l) in owner)
    owner.update((id(l), s) for l in stage_layers if id(l) not in owner)
    cost = sum(layer_cost(n.operation, n) for n in stage_nodes)
    params = sum(_num_params(l) for l in stage_layers
                 if owner[id(l)] == s)
    outputs = boundary[s + 1]
    if s and s < len(bounds) - 2:
      outputs = _passed_through(boundary[s], outputs, f"{model.name}_stage{s}")
    sub_model = keras.Model(boundary[s], outputs,
                            name=f"{model.name}_stage{s}")
    stages.append(Stage(s, stage_layers, float(cost), params, sub_model,
                        shared))
  plan = StagePlan(model, stages)
  cuts_lib.warn_imbalance(plan, [nodes[bounds[s]:bounds[s + 1]]
                                 for s in range(len(stages))], layer_cost)
  return plan
