"""`ExpertTensorParallelExtended`: expert parallelism on a data x tensor
mesh, the replica-head design (`spmd=False`; `spmd_extended.py` is the
default, SPMD). `ExpertTensorLayout` is what both designs share.

Everything but the experts is laid out as `TensorParallelStrategy` lays
it out (attention by heads, MLPs column- then row-parallel, embeddings on
the vocabulary; each replica a tensor group whose head runs the replicated
work). The experts of each MoE layer are spread over the `expert x tensor`
devices of an expert group, whole experts on each device (Megatron-Core's
MoE parallel folding with expert-tensor size 1, torchtitan's ETP 1): the
expert group is `expert` consecutive replicas, the replica of expert rank
j holds experts `j*E/e ... (j+1)*E/e - 1`, and its k-th device the
`E/(e*t)` of them in slot `j*t + k`.

A token goes from its replica's head to the head of its experts' replica
in the all-to-all of the data-only layout; there the rows of each tensor
column's experts go to that device, which runs them (forward and
backward), and their outputs come back to the head for the return
all-to-all. Each expert's matmuls stay whole (no partial sums, so nothing
depends on `communication_dtype`), and a head sends each of its t - 1
other devices 1/t of what it received.
"""

import tensorflow as tf

from tfpar.common.split_weights import logical_entries
from tfpar.common.split_weights import sharded_weights
from tfpar.common import whole_weights
from tfpar.expert_parallel import context as context_lib
from tfpar.expert_parallel import extended as expert_extended
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import optimizer as expert_optimizer
from tfpar.tensor_parallel import compute
from tfpar.tensor_parallel import extended as tensor_extended


class ExpertTensorLayout:
  """What expert x tensor does under either tensor-parallel design: the
  experts laid out by expert parallelism, everything else by the tensor
  plan. Mixed in before `expert_extended.ExpertSplitting` and a tensor
  `StrategyExtended`, which provides `shard_model` and `_adopt`; a
  subclass gives `tensor_entries(optimizer, model)` (the optimizer's
  variables, split slots whole) and `moe_context_options()` (how its
  `MoEContext` runs experts on the tensor columns).

  Args:
    container_strategy: the public strategy.
    mesh: a `tfpar.Mesh` with data and tensor axes (pipeline 1).
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


class ExpertTensorParallelExtended(ExpertTensorLayout,
                                   expert_extended.ExpertSplitting,
                                   tensor_extended.TensorParallelExtended):
  """The logic of `tfpar.ExpertParallelStrategy(..., spmd=False)` on a
  data x tensor mesh (the replica-head design; arguments as
  `ExpertTensorLayout`'s)."""

  def moe_context_options(self):
    """Each replica's head runs the MoE blocks and hands each column's
    rows to its device."""
    return {"on_column": self._on_column}

  def _on_column(self, column, fn, rows):
    """`fn(rows)` forward and backward on the running replica's device
    `column` (its experts' variables are there)."""
    device = self.current_group()[column]
    with tf.device(device):
      rows = tf.identity(rows)
    return compute.on_device(device, fn, rows)

  def column_scopes(self, block):
    del block
    return [self.variables_on_column(k) for k in range(self.tensor_size)]

  def tensor_entries(self, optimizer, model):
    return logical_entries(optimizer.variables, sharded_weights(model))


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
