"""`Candidate` and `PlanResult`: the planner's answer, as a table."""

import dataclasses
from typing import Optional, Tuple

from tfpar.planner import formulas
from tfpar.planner import layout as layout_lib
from tfpar.planner import units


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout and the memory of its fullest device.

  Attributes:
    layout: the `tfpar.planner.Layout`.
    memory: its `MemoryEstimate`.
    fits: whether `memory.total`, and `build_peak`, are at most the memory
      per device.
    supported: whether tfpar can run the layout today.
    unsupported_reason: why not, when it cannot.
    rank: its expected speed order key (lower is faster).
    build_peak: bytes of weights on the fullest device while the model is
      built, before its first step (`build_peak.py`).
  """
  layout: layout_lib.Layout
  memory: formulas.MemoryEstimate
  fits: bool
  supported: bool = True
  unsupported_reason: str = ""
  rank: tuple = ()
  build_peak: int = 0

  @property
  def name(self):
    """The layout's name, e.g. "DP64 + ZeRO-1"."""
    return self.layout.name


@dataclasses.dataclass(frozen=True)
class PlanResult:
  """What `tfpar.plan` found: every candidate, the recommendation, why.

  Prints as a table: one row per candidate worth reading (the data-parallel
  family, the seeds' ZeRO chart, plus every layout that needs less memory
  than all faster ones), then the recommendation and its reason.

  Attributes:
    model_name: the model's name.
    devices: N.
    memory_per_device: bytes available on each device.
    precision: "fp32", "mixed", "mixed_float16" or "mixed_bfloat16".
    batch_size: the global batch the activations are estimated for.
    slots_per_weight: optimizer slots per weight.
    candidates: every `Candidate`, fastest first.
    recommended: the recommended `Candidate`, or None when nothing fits.
    reason: the recommendation explained (or why nothing fits).
    notes: assumptions and the layouts left out, with why.
    has_activations: whether activations were estimated (needs a model).
    gradient_accumulation_steps: k when the plan counts Keras's gradient
      accumulators, else None.
  """
  model_name: str
  devices: int
  memory_per_device: int
  precision: str
  batch_size: int
  slots_per_weight: int
  candidates: Tuple[Candidate, ...]
  recommended: Optional[Candidate]
  reason: str
  notes: Tuple[str, ...] = ()
  has_activations: bool = True
  gradient_accumulation_steps: Optional[int] = None

  def shown(self, all_candidates=False):
    """The candidates the table and the picture show, fastest first.

    The readable subset: the data-parallel family (the seeds' ZeRO chart),
    every candidate that needs less memory than all faster ones, the
    recommendation, and for each other family (tensor, pipeline or both;
    with or without ZeRO-1, recompute) its fastest layout that fits, or
    its smallest when none fits.

    Args:
      all_candidates: every candidate instead of the readable subset.

    Example:

    >>> import tfpar.planner
    >>> result = tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
    >>> [c.name for c in result.shown()][:4]
    ['DP64', 'DP64 + ZeRO-1', 'DP64 + ZeRO-2', 'DP64 + ZeRO-3']
    """
    if all_candidates:
      return list(self.candidates)
    keep, best, families = set(), None, {}
    for candidate in self.candidates:
      layout, total = candidate.layout, candidate.memory.total
      if (layout.tensor == layout.pipeline == 1 or best is None or
          total < best or candidate is self.recommended):
        keep.add(id(candidate))
      best = total if best is None else min(best, total)
      family = (layout.tensor > 1, layout.pipeline > 1, bool(layout.zero),
                layout.recompute, bool(layout.offload))
      chosen = families.get(family)
      if chosen is None or (not chosen.fits and (
          candidate.fits or total < chosen.memory.total)):
        families[family] = candidate
    keep.update(id(c) for c in families.values())
    return [c for c in self.candidates if id(c) in keep]

  def table(self, all_candidates=False):
    """The table as text.

    Args:
      all_candidates: one row for every candidate.

    Example:

    >>> import tfpar.planner
    >>> print(tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
    ...       .table().splitlines()[2])  # doctest: +NORMALIZE_WHITESPACE
    DP64  15 GB  15 GB  90 GB  -  120 GB  0  15 GB  no  runs
    """
    rows = self.shown(all_candidates)
    with_host = any(c.memory.host for c in rows)
    with_accumulators = any(c.memory.accumulators for c in rows)
    header = ["layout", "parameters", "gradients", "optimizer",
              "activations", "total", "build", "fits", "tfpar"]
    if with_host:
      header.insert(6, "host")
    if with_accumulators:
      header.insert(3, "accumulators")
    lines = [header]
    for candidate in rows:
      memory = candidate.memory
      cells = [
          ("* " if candidate is self.recommended else "") + candidate.name,
          units.format_bytes(memory.parameters),
          units.format_bytes(memory.gradients),
          units.format_bytes(memory.optimizer),
          (units.format_bytes(memory.activations) if self.has_activations
           else "-"),
          units.format_bytes(memory.total),
          units.format_bytes(candidate.build_peak),
          "yes" if candidate.fits else "no",
          "runs" if candidate.supported else "not yet"]
      if with_host:
        cells.insert(6, units.format_bytes(memory.host))
      if with_accumulators:
        cells.insert(3, units.format_bytes(memory.accumulators))
      lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [self.title()]
    for row in lines:
      text.append("  ".join(
          cell.ljust(width) if i == 0 else cell.rjust(width)
          for i, (cell, width) in enumerate(zip(row, widths))).rstrip())
    hidden = len(self.candidates) - len(rows)
    if hidden:
      text.append(f"({hidden} slower candidates that need more memory are not "
                  f"shown; table(all_candidates=True) lists them.)")
    return "\n".join(text)

  def title(self):
    """One line: model, devices, memory, precision, batch."""
    batch = (f"global batch {self.batch_size}" if self.has_activations
             else "model states only")
    steps = self.gradient_accumulation_steps
    accumulation = (f"gradient accumulation over {steps} steps, " if steps
                    else "")
    return (f"Memory per device for {self.model_name!r} on {self.devices} "
            f"devices with {units.format_bytes(self.memory_per_device)} each "
            f"({self.precision}, {self.slots_per_weight} optimizer slots per "
            f"weight, {accumulation}{batch})")

  def __str__(self):
    parts = [self.table(), "", self.reason]
    if self.notes:
      parts += ["", "Notes:"] + [f"- {note}" for note in self.notes]
    return "\n".join(parts)

  def plot(self, path, all_candidates=False):
    """Writes the memory bar chart of the shown candidates as a PNG.

    One stacked bar per candidate (parameters, gradients, optimizer state,
    activations per device), the memory per device as a red line, the
    recommendation framed.

    Args:
      path: the PNG file to write.
      all_candidates: one bar for every candidate.

    Returns:
      `path`.

    Example:

    >>> import tfpar.planner
    >>> result = tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
    >>> result.plot("/tmp/plan.png")  # doctest: +SKIP
    '/tmp/plan.png'
    """
    from tfpar.planner import chart  # pylint: disable=g-import-not-at-top
    return chart.write_png(self, path, self.shown(all_candidates))

  def write_recipe(self, path, candidate=None):
    """Writes a layout as a recipe file for `tfpar.from_recipe` and
    `tfpar launch --recipe PATH`.

    Args:
      path: the `.toml` file to write.
      candidate: the `Candidate` to write; default the recommendation.

    Returns:
      `path`.

    Raises:
      ValueError: no candidate given and none fits.

    Example:

    >>> import tfpar.planner
    >>> result = tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
    >>> result.write_recipe("/tmp/mine.toml")  # doctest: +SKIP
    '/tmp/mine.toml'
    """
    from tfpar.planner import to_recipe  # pylint: disable=g-import-not-at-top
    candidate = candidate or self.recommended
    if candidate is None:
      raise ValueError(
          f"No layout of {self.model_name!r} fits "
          f"{units.format_bytes(self.memory_per_device)} per device, so "
          f"there is no recommendation to write; pass candidate= to write "
          f"another.")
    comment = (
        f"Written by tfpar plan: {self.title()}.\n"
        f"{candidate.name} needs {units.format_bytes(candidate.memory.total)}"
        f" on its fullest device.\n"
        f"Run it: tfpar launch --recipe {path} train.py, or "
        f"tfpar.from_recipe({path!r}).")
    with open(path, "w") as f:
      f.write(to_recipe.recipe_text(candidate.layout, comment,
                                    self.precision,
                                    self.gradient_accumulation_steps))
    return path
