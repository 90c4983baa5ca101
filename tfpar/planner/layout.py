"""`Layout`: one way to lay a model out on `data x pipeline x tensor`
devices (with ZeRO, offload, recompute, a pipeline schedule and expert
groups), validated when made; the planner's formulas price it."""

import dataclasses
from typing import Optional

from tfpar.planner import units

SCHEDULES = ("1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class Layout:
  """One way to lay a model out on `data x pipeline x tensor` devices.

  Args:
    data: data-parallel degree d (replicas).
    tensor: tensor-parallel degree t.
    pipeline: pipeline degree p (stages).
    zero: None, or the ZeRO stage 1, 2 or 3 over the d replicas.
    offload: None, or "cpu" to keep the optimizer state on the host.
    recompute: keep only each stage's inputs and recompute the stage in
      its backward (pipelines only).
    num_microbatches: micro-batches per replica batch m (pipelines only);
      default 4p, the seeds' "at least 4x as many micro-batches as stages".
    schedule: "1f1b" (at most p micro-batches of activations alive) or
      "gpipe" (all m alive).
    expert: expert-group size e: each MoE layer's experts split over
      groups of e of the d replicas (`tfpar.ExpertParallelStrategy`), the
      rest data-parallel; 1 for none.

  Raises:
    ValueError: a degree below 1, an unknown stage, offload or schedule,
      offload without ZeRO, recompute without a pipeline, or an expert size
      that does not divide d or comes with tensor, pipeline or ZeRO.

  Example:

  >>> from tfpar.planner import Layout
  >>> Layout(data=2, tensor=2, zero=1).name
  'DP2 x TP2 + ZeRO-1'
  >>> Layout(data=8, expert=4).name
  'DP8 + EP4'
  """
  data: int = 1
  tensor: int = 1
  pipeline: int = 1
  zero: Optional[int] = None
  offload: Optional[str] = None
  recompute: bool = False
  num_microbatches: Optional[int] = None
  schedule: str = "1f1b"
  expert: int = 1

  def __post_init__(self):
    for setting in ("data", "tensor", "pipeline", "expert"):
      units.check_positive_int(getattr(self, setting), setting)
    units.check_choice(self.zero, "zero", (None, 1, 2, 3))
    units.check_choice(self.offload, "offload", (None, "cpu"))
    units.check_choice(self.schedule, "schedule", SCHEDULES)
    if self.offload and self.zero is None:
      raise ValueError(
          f"offload needs a ZeRO stage (tfpar.ZeRO(stage, offload='cpu') "
          f"offloads the state it shards). Received: offload="
          f"{self.offload!r}, zero=None.")
    if self.recompute and self.pipeline == 1:
      raise ValueError(
          "recompute keeps the inputs of pipeline stages, so it needs "
          "pipeline >= 2. Received: recompute=True, pipeline=1.")
    if self.num_microbatches is not None:
      units.check_positive_int(self.num_microbatches, "num_microbatches")
    if self.expert > 1:
      self._check_expert()

  def _check_expert(self):
    if self.data % self.expert:
      raise ValueError(
          f"expert must divide data (the expert groups are carved out of "
          f"the data replicas). Received: expert={self.expert}, "
          f"data={self.data}.")
    if self.tensor > 1 or self.pipeline > 1 or self.zero:
      raise ValueError(
          f"expert parallelism runs over the data axis alone: "
          f"tfpar.ExpertParallelStrategy refuses tensor and pipeline axes, "
          f"and ZeRO on top of it is untested. Received: expert="
          f"{self.expert}, tensor={self.tensor}, pipeline={self.pipeline}, "
          f"zero={self.zero}.")

  @property
  def devices(self):
    """d * t * p."""
    return self.data * self.tensor * self.pipeline

  @property
  def microbatches(self):
    """m: `num_microbatches`, or 4p for a pipeline, or 1."""
    if self.num_microbatches is not None:
      return self.num_microbatches
    return 4 * self.pipeline if self.pipeline > 1 else 1

  @property
  def name(self):
    """E.g. "DP16 x TP4 + ZeRO-1", "DP2 x PP2 + recompute", "DP8 + EP4"."""
    parts = [f"DP{self.data}"]
    if self.tensor > 1:
      parts.append(f"TP{self.tensor}")
    if self.pipeline > 1:
      parts.append(f"PP{self.pipeline}")
    name = " x ".join(parts)
    if self.expert > 1:
      name += f" + EP{self.expert}"
    if self.zero:
      name += f" + ZeRO-{self.zero}"
    if self.offload:
      name += " + offload"
    if self.recompute:
      name += " + recompute"
    return name
