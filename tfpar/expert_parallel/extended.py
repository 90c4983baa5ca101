"""`ExpertParallelExtended`: splits the experts of MoE layers built in its
scope over expert groups of data replicas (see `groups.py`); the state
their calls share is a `context.MoEContext`."""

import numpy as np
import tensorflow as tf

from tfpar.common import whole_weights
from tfpar.engine import extended as engine_extended
from tfpar.expert_parallel import context as context_lib
from tfpar.expert_parallel import families
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import layers
from tfpar.expert_parallel import optimizer as optimizer_lib
from tfpar.expert_parallel import variables as variables_lib
from tfpar.expert_parallel import whole_experts
from tfpar.memory import components


class ExpertSplitting:
  """What every expert-parallel `StrategyExtended` does: split the experts
  of MoE blocks over the expert group and report routing. Mixed into
  `ExpertParallelExtended` (a data-only mesh) and
  `tensor_extended.ExpertTensorParallelExtended` (data x tensor), whose
  `__init__` set `self._context` (a `context.MoEContext`)."""

  @property
  def context(self):
    return self._context

  def local_replica_ids(self):
    """Global ids of this worker's replicas, in local order."""
    replicas = self._mesh.replicas
    return [replicas.index(group) for group in self._local_groups]

  def expert_placement(self, block):
    """None (`block`'s experts where the strategy puts a variable), or a
    context placing them (its pipeline stage's device of every replica;
    every device under expert x tensor)."""
    del block
    return None

  def expert_slots(self):
    """(the slot of each local component of an expert variable, the
    number of slots): a slot per expert rank, held by each local
    replica's component (under expert x tensor the component on the k-th
    device holds slot `rank * tensor + k`)."""
    ranks = [self._context.groups.expert_rank(r)
             for r in self.local_replica_ids()]
    return ranks, self._context.groups.expert

  def first_column(self, block):
    """The device column of every replica that runs `block` (and holds
    its experts)."""
    del block
    return 0

  def checked_blocks(self, model, unsplit=False):
    """`model`'s (block, family) MoE blocks, each checked to fit the
    expert group (x the tensor columns); with `unsplit`, only those whose
    experts are not split yet.

    Raises:
      ValueError: the model has no MoE block, or a block whose experts or
        top-k do not fit the expert size.
    """
    unknown = families.unknown_moe_blocks(model)
    if unknown:
      raise ValueError(
          f"Model {model.name!r} has mixture-of-experts layer(s) tfpar does "
          f"not know: "
          f"{', '.join(f'{b.path!r} ({type(b).__name__})' for b in unknown)}"
          f" (known: {', '.join(families.ROWS)}). Their experts would stay "
          f"replicated; add the class's row to ROWS in "
          f"tfpar/expert_parallel/families.py.")
    blocks = families.moe_blocks(model)
    if not blocks:
      raise ValueError(
          f"Model {model.name!r} has no mixture-of-experts layer that "
          f"tfpar can split (known: {', '.join(families.ROWS)}); use "
          f"tfpar.DataParallelStrategy for it.")
    for block, _ in blocks:
      check_block(block, self._context.groups.expert, self._context.columns)
    return [(block, family) for block, family in blocks
            if not (unsplit and getattr(block, "_tfpar_experts_split", False))]

  def expert_weight_paths(self, model, unsplit=False):
    """Paths of the expert weights of `model`'s `checked_blocks`: the
    weights this layout splits, which the other parallelism of the mesh
    must leave where they were created."""
    return frozenset(
        getattr(family.bank, name).path
        for block, family in self.checked_blocks(model, unsplit)
        for name in family.expert_weight_names)

  def split_experts(self, model):
    """Splits the experts of every MoE block of a built model.

    Raises:
      ValueError: the model has no MoE block, or a block whose experts or
        top-k do not fit the expert size.
    """
    blocks = self.checked_blocks(model, unsplit=True)
    optimizer = getattr(model, "optimizer", None)
    if blocks and optimizer is not None and optimizer.built:
      raise ValueError(
          f"The optimizer of model {model.name!r} was built before its "
          f"experts were split. Build the model inside strategy.scope() "
          f"before compiling it.")
    ranks, slots = self.expert_slots()
    with self._container_strategy().scope():
      for block, family in blocks:
        bank = family.bank
        for name in family.expert_weight_names:
          variable = getattr(bank, name)
          weight = variables_lib.split_expert_weight(
              variable, ranks, slots, self.expert_placement(block))
          weight.gather = whole_experts.reader(self._context, weight)
          variables_lib.replace(bank, variable, weight)
          self._context.register(weight, block, self.first_column(block))
        with tf.init_scope():
          self._context.drop_counters[block.path] = tf.Variable(
              tf.zeros([2]), trainable=False,
              synchronization=tf.VariableSynchronization.ON_READ,
              aggregation=tf.VariableAggregation.SUM,
              name=f"{block.name}_dropped_routed")
        object.__setattr__(block, "call",
                           layers.build_call(block, family, self._context))
        object.__setattr__(block, "_tfpar_experts_split", True)
    object.__setattr__(model, "_tfpar_experts_split", True)
    whole_weights.install(model)

  def routing_report(self):
    """{MoE block path: (dropped assignments, routed assignments)} since
    the strategy started, summed over this worker's replicas."""
    report = {}
    for path, counter in self._context.drop_counters.items():
      total = np.sum([np.asarray(c.numpy()) for c in components(counter)],
                     axis=0)
      report[path] = (int(total[0]), int(total[1]))
    return report


class ExpertParallelExtended(ExpertSplitting, engine_extended.MeshExtended):
  """The logic of `tfpar.ExpertParallelStrategy` on a data-only mesh.

  Args:
    container_strategy: the public strategy.
    mesh: a data-only `tfpar.Mesh`.
    expert: the expert-group size (divides the data size).
    capacity_factor: None or a positive number (see `routing.capacity`).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
  """

  def __init__(self, container_strategy, mesh, expert, capacity_factor,
               communication_options=None):
    groups = groups_lib.ExpertGroups(mesh.num_replicas, expert)
    super().__init__(container_strategy, mesh, communication_options)
    self._context = context_lib.MoEContext(self, groups, capacity_factor)

  preparation = "split its experts, so they would stay replicated"

  def is_prepared(self, model):
    return getattr(model, "_tfpar_experts_split", False)

  def prepare_model(self, model):
    if not self.is_prepared(model) and model.built:
      self.split_experts(model)
    if self.is_prepared(model) and getattr(model, "optimizer", None):
      optimizer_lib.adopt(model.optimizer, self._context, clip_model=model)

  def adopt_loop_optimizer(self, optimizer, model, variables):
    """A custom training loop's optimizer sums the experts' gradients over
    their expert-data groups and clips by whole weights, as a compiled
    one does."""
    if model is None:
      super().adopt_loop_optimizer(optimizer, model, variables)
    else:
      optimizer_lib.adopt(optimizer, self._context, clip_model=model)


def check_block(block, expert, tensor=1):
  """Raises unless `block`'s experts and top-k fit the expert size (times
  the tensor size under expert x tensor, whose devices each hold
  num_experts / (expert x tensor) experts)."""
  num_experts, top_k = block.num_experts, block.top_k
  fits = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
  if num_experts % expert:
    raise ValueError(
        f"Layer {block.path!r}: num_experts={num_experts} is not divisible "
        f"by expert={expert}, so its experts cannot be split evenly over "
        f"the expert group. Use an expert size in {fits} that divides the "
        f"data size.")
  if num_experts % (expert * tensor):
    raise ValueError(
        f"Layer {block.path!r}: num_experts={num_experts} is not divisible "
        f"by expert x tensor = {expert} x {tensor}: under expert x tensor "
        f"each of the {expert * tensor} devices of an expert group holds "
        f"whole experts, num_experts / (expert x tensor) of them. Use "
        f"expert x tensor in {fits}.")
  if not 1 <= top_k <= num_experts:
    raise ValueError(
        f"Layer {block.path!r}: top_k={top_k} must be between 1 and "
        f"num_experts={num_experts} (each token picks top_k distinct "
        f"experts).")
