"""`ExpertTensorParallelExtended`: expert parallelism on a data x tensor
mesh (`tfpar.ExpertParallelStrategy` with a tensor axis).

Everything but the experts is laid out and run as `TensorParallelStrategy`
lays it out and runs it (attention by heads, MLPs column- then
row-parallel, embeddings on the vocabulary): every device of a replica's
tensor group traces the step, and the tensor-parallel reductions are
collectives of the group. The experts of each MoE layer are spread over
the `expert x tensor` devices of an expert group, whole experts on each
device (Megatron-Core's MoE parallel folding with expert-tensor size 1,
torchtitan's ETP 1): the expert group is `expert` consecutive replicas,
the replica of expert rank j holds experts `j*E/e ... (j+1)*E/e - 1`, and
its k-th device the `E/(e*t)` of them in slot `j*t + k`. One variable
holds a layer's experts: its component on each device is that device's
slot, as a split weight's component is its shard.

Each device routes its copy of the tokens and exchanges its own experts'
rows with the same column of its expert group (`spmd_exchange.py`), so no
device forwards another's rows; each device's expert gradients are summed
over its expert-data group, the same column of the replicas of its expert
rank. Each expert's matmuls stay whole (no partial sums, so nothing
depends on `communication_dtype`).
"""

from tfpar.common import whole_weights
from tfpar.engine import extended as engine_extended
from tfpar.engine import spread
from tfpar.expert_parallel import context as context_lib
from tfpar.expert_parallel import extended as expert_extended
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import optimizer as expert_optimizer
from tfpar.tensor_parallel import extended as tensor_extended
from tfpar.tensor_parallel.spmd import weights as spmd_weights


class ExpertTensorParallelExtended(expert_extended.ExpertSplitting,
                                   tensor_extended.TensorParallelExtended):
  """The logic of `tfpar.ExpertParallelStrategy` on a data x tensor mesh:
  the experts laid out by expert parallelism (`ExpertSplitting`),
  everything else by the tensor plan (`TensorParallelExtended`'s
  `shard_model` and `_adopt`).

  Args:
    container_strategy: the public strategy.
    mesh: a `tfpar.Mesh` with data and tensor axes (pipeline 1; each
      tensor group on one worker).
    expert: the expert-group size (divides the data size).
    capacity_factor: None or a positive number (see `routing.capacity`).
    plan: a `tfpar.ShardingPlan` for the weights other than the experts.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
  """

  def __init__(self, container_strategy, mesh, expert, capacity_factor,
               plan, communication_options=None):
    groups = groups_lib.ExpertGroups(mesh.num_replicas, expert)
    super().__init__(container_strategy, mesh, plan, communication_options,
                     float32_sums=True)
    self._context = context_lib.MoEContext(
        self, groups, capacity_factor, columns=self.tensor_size,
        **self.moe_context_options())

  preparation = ("shard it and split its experts, so its weights would stay "
                 "replicated")

  def is_prepared(self, model):
    return (super().is_prepared(model) and
            getattr(model, "_tfpar_experts_split", False))

  def laid_out_elsewhere(self, model):
    """The expert weights of `model`'s MoE blocks (checked to fit the
    expert group x tensor before anything is laid out)."""
    return self.expert_weight_paths(model, unsplit=True)

  def prepare_model(self, model):
    if model.built and not super().is_prepared(model):
      self.checked_blocks(model)  # Raises: no MoE layer, or one that misfits.
      self.shard_model(model)
    if model.built and not getattr(model, "_tfpar_experts_split", False):
      self.split_experts(model)
    optimizer = getattr(model, "optimizer", None)
    if self.is_prepared(model) and optimizer is not None:
      self._adopt_for(optimizer, model)

  def adopt_loop_optimizer(self, optimizer, model, variables):
    """A custom training loop's optimizer is prepared as a compiled one."""
    if model is None:
      engine_extended.MeshExtended.adopt_loop_optimizer(
          self, optimizer, model, variables)
    else:
      self._adopt_for(optimizer, model)

  def _adopt_for(self, optimizer, model):
    check_clipping(optimizer)
    self._adopt(optimizer, model)
    expert_optimizer.adopt(
        optimizer, self._context,
        items=lambda: self.tensor_entries(optimizer, model))

  def describe_elsewhere(self, model):
    """{expert weight path: (style, shard shape, devices)} for
    `ShardingPlan.describe`."""
    expert, tensor = self._context.groups.expert, self.tensor_size
    replicas = self._mesh.replicas
    rows = {}
    held = whole_weights.held(model)  # `weights` lists them whole.
    for weight in self._context.expert_weights():
      if not any(weight.variable is v for v in held):
        continue
      shape = weight.shape
      local = (shape[0] // (expert * tensor),) + tuple(shape[1:])
      slots = []
      for slot in range(expert * tensor):
        rank, column = divmod(slot, tensor)
        devices = ",".join(
            replicas[r][column].split("device:")[-1]
            for r in range(len(replicas)) if r % expert == rank)
        slots.append(f"{slot}: {devices}")
      rows[weight.path] = (f"Experts axis 0 (expert {expert} x tensor "
                           f"{tensor})", str(local), " | ".join(slots))
    return rows

  def moe_context_options(self):
    """Every device of a replica runs the MoE blocks and its own
    experts."""
    return {"stage_columns": range(self.tensor_size),
            "tensor_groups": self.tensor_groups}

  def expert_slots(self):
    t = self.tensor_size
    ranks, _ = super().expert_slots()
    return ([rank * t + k for rank in ranks for k in range(t)],
            self._context.groups.expert * t)

  def expert_placement(self, block):
    del block
    # One variable on every device (its component there: the device's
    # slot), made as the strategy makes a variable, not spread.
    return spread.creating_in_place()

  def checked_blocks(self, model, unsplit=False):
    blocks = super().checked_blocks(model, unsplit)
    for block, family in blocks:
      check_no_jitter(block, family)
    return blocks

  def tensor_entries(self, optimizer, model):
    return spmd_weights.optimizer_entries(optimizer, model)


def check_clipping(optimizer):
  """Raises for clipping by norm, which expert x tensor does not compute
  as one device does yet (measured: `global_clipnorm` clipping after the
  sums, by the experts' norms summed over the expert group, ends 3e-4 from
  one device where the data-only layout is 3e-8 off)."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  for name in ("clipnorm", "global_clipnorm"):
    if getattr(inner, name, None):
      raise ValueError(
          f"Optimizer {inner.name!r} has {name}={getattr(inner, name)}: "
          f"expert x tensor parallelism does not clip by norm as one device "
          f"does yet (an expert weight's norm spans its expert group). Use "
          f"clipvalue, or a mesh without a tensor axis.")


def check_no_jitter(block, family):
  """Raises for router jitter noise, which each device of a tensor group
  would draw apart (their copies of the tokens would route differently)."""
  jitter = getattr(block, family.jitter, 0.0) if family.jitter else 0.0
  if jitter:
    raise ValueError(
        f"Layer {block.path!r} has {family.jitter}={jitter}: under expert x "
        f"tensor parallelism every device of a tensor group routes its own "
        f"copy of the tokens, and jitter noise drawn on each device would "
        f"route them differently. Set {family.jitter}=0, or use a mesh "
        f"without a tensor axis.")
