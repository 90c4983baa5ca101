"""`ExpertSpmdTensorParallelExtended`: expert parallelism on a data x
tensor mesh, SPMD (the default of `tfpar.ExpertParallelStrategy`).

Everything but the experts is laid out and run as
`TensorParallelStrategy(spmd=True)` runs it: every device of a replica's
tensor group traces the step, and the tensor-parallel reductions are
collectives of the group. The experts of each MoE layer are spread over
the `expert x tensor` devices of an expert group as under the head design
(whole experts; slot `j * t + k` of the `expert x t` slots on the k-th
device of every replica of expert rank j), but one variable holds them:
its component on each device is that device's slot, as an SPMD split
weight's component is its shard. Each device routes its copy of the
tokens and exchanges its own experts' rows with the same column of its
expert group (`spmd_exchange.py`), so no device forwards another's
rows; each device's expert gradients are summed over its expert-data
group, the same column of the replicas of its expert rank.
"""

from tfpar.engine import spread
from tfpar.expert_parallel import extended as expert_extended
from tfpar.expert_parallel import tensor_extended
from tfpar.tensor_parallel.spmd import extended as spmd_extended
from tfpar.tensor_parallel.spmd import weights as spmd_weights


class ExpertSpmdTensorParallelExtended(
    tensor_extended.ExpertTensorLayout, expert_extended.ExpertSplitting,
    spmd_extended.SpmdTensorParallelExtended):
  """The logic of `tfpar.ExpertParallelStrategy` on a data x tensor mesh
  (`spmd=True`; arguments as `ExpertTensorLayout`'s, each tensor group on
  one worker)."""

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

  def column_scopes(self, block):
    del block
    # One variable on every device (its component there: the device's
    # slot), made as the strategy makes a variable, not spread.
    return [spread.creating_in_place()]

  def checked_blocks(self, model, unsplit=False):
    blocks = super().checked_blocks(model, unsplit)
    for block, family in blocks:
      check_no_jitter(block, family)
    return blocks

  def tensor_entries(self, optimizer, model):
    return spmd_weights.optimizer_entries(optimizer, model)


def check_no_jitter(block, family):
  """Raises for router jitter noise, which each device of a tensor group
  would draw apart (their copies of the tokens would route differently)."""
  jitter = getattr(block, family.jitter, 0.0) if family.jitter else 0.0
  if jitter:
    raise ValueError(
        f"Layer {block.path!r} has {family.jitter}={jitter}: under "
        f"ExpertParallelStrategy(spmd=True) every device of a tensor group "
        f"routes its own copy of the tokens, and jitter noise drawn on each "
        f"device would route them differently. Set {family.jitter}=0, or "
        f"use spmd=False (one device of each group routes).")
