"""`ExpertPipelineExtended`: expert parallelism inside pipeline stages
(`PipelineParallelStrategy(mesh, expert=e)` on a data x pipeline mesh).

The model is cut into stages as without experts; stage s lives on the
s-th device of every replica. Each MoE layer's experts are then split over
the expert group of its stage: the stage-s devices of `expert` consecutive
data replicas, the replica of expert rank j holding experts
`j*E/e ... (j+1)*E/e - 1` on its stage-s device (as Megatron-Core's and
torchtitan's expert groups live inside one pipeline stage). The
all-to-alls of a layer, the sums of its router statistics and its experts'
gradient sums join the stage-s devices of the replicas only, so stages
never wait on each other's collectives.

Every micro-batch is routed as one device routes it: each replica's
micro-batch k meets the other replicas' micro-batch k in the all-to-alls,
and the load-balancing loss of micro-batch k is computed from the router
statistics of micro-batch k summed over every replica (weighted by its
share of the batch, as the pipeline weighs every loss term).
"""


from tfpar._compat import keras_layers
from tfpar.common import whole_weights
from tfpar.expert_parallel import context as context_lib
from tfpar.expert_parallel import extended as expert_extended
from tfpar.expert_parallel import families
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import optimizer as expert_optimizer
from tfpar.pipeline import extended as pipeline_extended
from tfpar.pipeline import placement


class ExpertPipelineExtended(expert_extended.ExpertSplitting,
                             pipeline_extended.PipelineParallelExtended):
  """The logic of `tfpar.PipelineParallelStrategy` with `expert=`.

  Args:
    container_strategy: the public strategy.
    mesh: a `tfpar.Mesh` with data and pipeline axes (tensor 1).
    expert: the expert-group size (divides the data size).
    capacity_factor: None or a positive number (see `routing.capacity`).
    **pipeline_options: `PipelineParallelExtended`'s arguments.
  """

  def __init__(self, container_strategy, mesh, expert, capacity_factor,
               **pipeline_options):
    groups = groups_lib.ExpertGroups(mesh.num_replicas, expert)
    super().__init__(container_strategy, mesh, **pipeline_options)
    self._stage_columns = {}  # block path -> its stage's device column
    self._context = context_lib.MoEContext(
        self, groups, capacity_factor,
        stage_columns=range(self.pipeline_size))

  preparation = ("cut it into pipeline stages and split its experts, so its "
                 "experts would stay replicated")

  def is_prepared(self, model):
    # A model inside another (a task model's backbone) is prepared with it.
    return super().is_prepared(model) and (
        getattr(model, "_tfpar_experts_split", False) or
        self._outer_model(model) is not None)

  def laid_out_elsewhere(self, model):
    """The expert weights of `model`'s MoE blocks, checked to fit the
    expert group before anything moves."""
    return self.expert_weight_paths(model)

  def lay_out_elsewhere(self, model, plan):
    """Splits each MoE block's experts onto its stage's devices."""
    stage_of = plan.stage_of_layers()
    for block, _ in families.moe_blocks(model):
      if id(block) not in stage_of:
        raise ValueError(
            f"MoE layer {block.path!r} is called by no pipeline stage of "
            f"model {model.name!r}, so its experts have no stage devices.")
      self._stage_columns[block.path] = placement.stage_column(
          stage_of[id(block)], self.pipeline_size)
    self.split_experts(model)

  def first_column(self, block):
    return self._stage_columns[block.path]

  def expert_placement(self, block):
    return self.variables_on_column(self.first_column(block))

  def prepare_model(self, model):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:  # Before the pipeline would clip after sums.
      _check_clipping(optimizer)
    super().prepare_model(model)
    if self.is_prepared(model) and optimizer is not None:
      expert_optimizer.adopt(optimizer, self._context)

  def describe_elsewhere(self, model):
    """{expert weight path: (style, shard shape, devices)} for
    `ShardingPlan.describe`: each expert rank's slot on its stage's
    device of the replicas of that rank."""
    expert = self._context.groups.expert
    replicas = self._mesh.replicas
    rows = {}
    held = whole_weights.held(model)  # `weights` lists them whole.
    for weight in self._context.expert_weights():
      if not any(weight.variable is v for v in held):
        continue
      column = self._context.column_of(
          keras_layers.storage(weight.variable))
      local = (weight.shape[0] // expert,) + tuple(weight.shape[1:])
      slots = " | ".join(
          f"{rank}: " + ",".join(replicas[r][column].split("device:")[-1]
                                 for r in range(len(replicas))
                                 if r % expert == rank)
          for rank in range(expert))
      row = (f"Experts axis 0 (expert {expert}, stage device {column})",
             str(local), slots)
      rows[weight.path] = row
      rows[weight.variable.path] = row  # What the plan resolves: skipped.
    return rows


def _check_clipping(optimizer):
  """Raises for gradient clipping, which expert x pipeline leaves to Keras:
  each replica's gradient clipped before the sum over replicas, not the
  model one device trains."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  for name in ("clipnorm", "global_clipnorm", "clipvalue"):
    if getattr(inner, name, None):
      raise ValueError(
          f"Optimizer {inner.name!r} has {name}={getattr(inner, name)}: "
          f"PipelineParallelStrategy(expert=...) does not clip the summed "
          f"gradient as one device does yet (Keras would clip each "
          f"replica's own gradient before the sum). Remove {name}, or "
          f"split experts without a pipeline axis "
          f"(tfpar.ExpertParallelStrategy clips as one device does).")
