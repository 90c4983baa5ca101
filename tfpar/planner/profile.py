"""What the planner knows of a model: weights and activations per stage.

`KerasProfile` reads a built Keras model: its variables (trainable or
not), its expert weights (`experts.moe_facts`), which of them tensor
parallelism splits (`ShardingPlan.resolve`), how
`PipelineParallelStrategy` cuts it into stages (`plan_stages`), and the
output shape of every layer of its graph (activations). `CountProfile`
stands for a model known only by its parameter count: tensor parallelism
splits every weight, stages are equal, activations unknown.
"""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class StageLoad:
  """Elements one device of a stage holds (its tensor group's head).

  Attributes:
    trainable: trainable weight elements.
    non_trainable: other weight elements.
    kept: activation elements per sample kept for the backward pass.
    inputs: activation elements per sample of the stage input.
  """
  trainable: int
  non_trainable: int = 0
  kept: float = 0.0
  inputs: float = 0.0


class CountProfile:
  """A model known by its parameter count only.

  Args:
    num_parameters: Ψ, trainable elements.
    name: a name for tables.

  Example:

  >>> from tfpar.planner.profile import CountProfile
  >>> CountProfile(7.5e9).stages(tensor=2, pipeline=3)[0].trainable
  1250000000
  """

  has_activations = False
  max_pipeline = None
  moe = None  # No mixture-of-experts layers known.

  def __init__(self, num_parameters, name=None):
    self.trainable = int(num_parameters)
    self.non_trainable = 0
    self.name = name or _count_name(num_parameters)

  def stages(self, tensor, pipeline):
    """Equal stages, every weight split over the tensor axis."""
    per_device = math.ceil(self.trainable / tensor / pipeline)
    return [StageLoad(per_device)] * pipeline


def _count_name(count):
  for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if count >= size:
      return f"{count / size:.3g}{suffix} parameters"
  return f"{count:.3g} parameters"


def _elements(shape, unknown):
  """Elements per sample of a (batch, ...) shape; None dims count 1."""
  count = 1
  for dim in tuple(shape)[1:]:
    if dim is None:
      unknown.add(tuple(shape))
    count *= dim or 1
  return count


def _attention_internals(layer, node, unknown):
  """Elements per sample MultiHeadAttention keeps inside: query, key,
  value projections, attention scores and the context before the output
  projection (all split by heads under tensor parallelism)."""
  query = tuple(node.input_tensors[0].shape)
  value = tuple(node.input_tensors[-1].shape)
  q_len = _elements(query[:-1], unknown)
  v_len = _elements(value[:-1], unknown)
  heads, key_dim = layer.num_heads, layer.key_dim
  value_dim = layer.value_dim or key_dim
  return (q_len * heads * key_dim + v_len * heads * (key_dim + value_dim) +
          heads * q_len * v_len + q_len * heads * value_dim)


class KerasProfile:
  """The weights and activations of a built Keras model.

  Args:
    model: a built Keras model (not under a tfpar strategy).
    sharding_plan: the `tfpar.ShardingPlan` tensor parallelism would use
      (default: the built-in plan).

  Raises:
    ValueError: the model is not built.

  Example:

  >>> import keras
  >>> from tfpar.planner.profile import KerasProfile
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  >>> KerasProfile(model).stages(1, 1)[0]
  StageLoad(trainable=10, non_trainable=0, kept=6.0, inputs=4.0)
  """

  def __init__(self, model, sharding_plan=None):
    from tfpar.pipeline import stages as stages_lib  # pylint: disable=g-import-not-at-top
    from tfpar.planner import experts  # pylint: disable=g-import-not-at-top
    if not model.built:
      raise ValueError(
          f"model {model.name!r} is not built, so its variables are not "
          f"known. Build it first (keras.Input, model.build(shape) or "
          f"calling it once).")
    self.model = model
    self.name = model.name
    self._sharding_plan = sharding_plan
    self._variables = {id(v): v for v in model.weights}
    self.trainable = sum(_size(v) for v in model.weights if v.trainable)
    self.non_trainable = sum(_size(v) for v in model.weights
                             if not v.trainable)
    self.moe = experts.moe_facts(model)  # None without MoE layers.
    self.unknown_shapes = set()
    self._kept = {}       # id(operation) -> elements per sample.
    self._attention = {}  # id(operation) -> internal elements per sample.
    try:
      graph = stages_lib.functional_graph(model)
    except ValueError:
      graph = None
    self.has_activations = graph is not None
    self._inputs = 0
    self._nodes = []
    self.max_pipeline = 1
    if graph is not None:
      self._read_graph(graph)
    self._tensor_cache, self._pipeline_cache = {}, {}

  def _read_graph(self, graph):
    from tfpar._compat import keras_layers  # pylint: disable=g-import-not-at-top
    from tfpar.pipeline import stages as stages_lib  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    unknown = self.unknown_shapes
    self._inputs = sum(_elements(t.shape, unknown)
                       for t in keras.tree.flatten(graph.inputs))
    nodes = keras_layers.ordered_nodes(graph)
    self._nodes = nodes
    for node in nodes:
      operation = node.operation
      self._kept[id(operation)] = self._kept.get(id(operation), 0) + sum(
          _elements(t.shape, unknown) for t in node.outputs)
      if isinstance(operation, keras.layers.MultiHeadAttention):
        self._attention[id(operation)] = _attention_internals(
            operation, node, unknown)
    self.max_pipeline = len(stages_lib.cut_points(graph, nodes)) + 1

  def _tensor_layout(self, tensor):
    """(ids of split variables, {id(op): output split?}) for degree t."""
    if tensor not in self._tensor_cache:
      from tfpar.tensor_parallel import plan as plan_lib  # pylint: disable=g-import-not-at-top
      from tfpar.tensor_parallel import layouts, styles  # pylint: disable=g-import-not-at-top
      split, column = set(), set()
      if tensor > 1:
        by_path = {v.path: v for v in self.model.weights}
        for layer in plan_lib.as_plan(self._sharding_plan).resolve(
            self.model, tensor):
          split.update(id(by_path[v.path]) for v in layer.variables
                       if v.axis is not None and v.path in by_path)
          if (layer.kind in (layouts.DENSE, layouts.EINSUM) and
              isinstance(layer.style, styles.ColumnParallel)):
            column.add(id(layer.layer))
      self._tensor_cache[tensor] = (split, column)
    return self._tensor_cache[tensor]

  def _stage_plan(self, pipeline):
    """[(operations, variables, input elements)] per stage."""
    if pipeline not in self._pipeline_cache:
      if pipeline == 1:
        found = [(set(self._kept), list(self._variables.values()),
                  self._inputs)]
      else:
        found = self._cut(pipeline)
      self._pipeline_cache[pipeline] = found
    return self._pipeline_cache[pipeline]

  def _cut(self, pipeline):
    """The stages `PipelineParallelStrategy(stages="auto")` cuts, found as
    `plan_stages` finds them but without building stage sub-models (which
    would add nodes to the model's layers)."""
    from tfpar.pipeline import stages as stages_lib  # pylint: disable=g-import-not-at-top
    graph = stages_lib.functional_graph(self.model)
    nodes = self._nodes
    layers = [n.operation for n in nodes]
    cuts = stages_lib.cut_points(graph, nodes)
    if len(nodes) < pipeline or len(cuts) < pipeline - 1:
      raise ValueError(
          f"model {self.name!r} cannot be cut into {pipeline} pipeline "
          f"stages: it has {len(cuts)} places where a single tensor joins "
          f"the layers before to the layers after.")
    if len({id(l) for l in layers}) != len(layers):
      raise ValueError(f"model {self.name!r} calls a layer more than once, "
                       f"so it cannot be cut into pipeline stages.")
    costs = [stages_lib.layer_cost(l, n) for l, n in zip(layers, nodes)]
    starts = stages_lib.balanced_cuts(costs, cuts, pipeline)
    bounds = [0] + list(starts) + [len(nodes)]
    found = []
    for s in range(pipeline):
      operations = layers[bounds[s]:bounds[s + 1]]
      variables = {id(v): v for o in operations
                   for v in getattr(o, "weights", ())}
      inputs = (self._inputs if s == 0 else
                _elements(cuts[bounds[s]].shape, self.unknown_shapes))
      found.append(({id(o) for o in operations}, list(variables.values()),
                    inputs))
    return found

  def stages(self, tensor, pipeline):
    """The `StageLoad` of every stage for tensor degree t, pipeline p.

    Raises:
      ValueError: tensor parallelism cannot split the model t ways, or the
        model cannot be cut into p stages.
    """
    split, column = self._tensor_layout(tensor)
    loads = []
    for operations, variables, inputs in self._stage_plan(pipeline):
      trainable = non_trainable = 0
      for variable in variables:
        size = _size(variable) // (tensor if id(variable) in split else 1)
        if variable.trainable:
          trainable += size
        else:
          non_trainable += size
      kept = float(inputs)
      for operation in operations:
        share = tensor if operation in column else 1
        kept += self._kept.get(operation, 0) / share
        if operation in self._attention:
          kept += self._attention[operation] / tensor
      loads.append(StageLoad(trainable, non_trainable, kept, float(inputs)))
    return loads


def _size(variable):
  return int(np.prod(variable.shape))
