"""Choosing a layout: the fastest that fits, and why, in words."""

import math

from tfpar.pipeline import schedules
from tfpar.planner import candidates as candidates_lib
from tfpar.planner import units


def recommend(candidates, memory_per_device, devices):
  """The recommended candidate and the reason, or (None, why nothing fits).

  The fastest candidate (in `rank` order) that fits and that tfpar can
  run; when only layouts tfpar cannot run yet fit, the fastest of those,
  saying so.

  Args:
    candidates: `Candidate`s, fastest first.
    memory_per_device: bytes per device.
    devices: N.

  Example:

  >>> import tfpar.planner
  >>> result = tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
  >>> result.recommended.name
  'DP64 + ZeRO-1'
  """
  fitting = [c for c in candidates if c.fits]
  if not fitting:
    return None, _nothing_fits(candidates, memory_per_device, devices)
  runnable = [c for c in fitting if c.supported]
  pick = runnable[0] if runnable else fitting[0]
  memory = pick.memory
  lines = [f"Recommended: {pick.name}. Its fullest device needs "
           f"{units.format_bytes(memory.total)} of the "
           f"{units.format_bytes(memory_per_device)} available "
           f"({100 * memory.total / memory_per_device:.0f}%)."]
  slower = _faster_that_do_not_fit(candidates, pick)
  if slower:
    lines.append("Faster layouts do not fit: " + "; ".join(slower) + ".")
  if fitting[0] is not pick:
    lines.append(
        f"{fitting[0].name} would be faster and fits "
        f"({units.format_bytes(fitting[0].memory.total)}), but tfpar cannot "
        f"run it yet: {fitting[0].unsupported_reason}.")
  if not pick.supported:
    lines.append(f"tfpar cannot run {pick.name} yet "
                 f"({pick.unsupported_reason}); no layout it runs fits.")
  lines.append("Rule applied: " + "; ".join(
      str(r) for r in candidates_lib.rules_for(pick.layout)) + ".")
  lines.extend(_details(pick))
  how = candidates_lib.how_to_run(pick.layout)
  if how:
    lines.append(f"Run it: {how}")
  return pick, "\n".join(lines)


def _faster_that_do_not_fit(candidates, pick):
  """Short notes on the faster candidates that need less memory than all
  faster ones (the ones worth a look), up to four."""
  notes, best = [], None
  for candidate in candidates:
    if candidate is pick:
      break
    total = candidate.memory.total
    if best is None or total < best:
      best = total
      if not candidate.fits:
        notes.append(f"{candidate.name} needs {units.format_bytes(total)}")
  if len(notes) > 4:
    notes = notes[:3] + [f"and {len(notes) - 3} more"]
  return notes


def _details(pick):
  layout, lines = pick.layout, []
  if layout.zero in (1, 2) and layout.tensor == layout.pipeline == 1:
    lines.append(
        f"ZeRO-{layout.zero} moves the same bytes per step as data "
        f"parallelism (reduce-scatter + all-gather instead of all-reduce), "
        f"so it comes before ZeRO-3 (1.5x) and model parallelism.")
  if layout.expert > 1:
    lines.append(
        f"Expert parallelism keeps 1/{layout.expert} of each MoE layer's "
        f"experts (and of their gradients and optimizer slots) on a device; "
        f"tokens reach their experts by all-to-all (2 forward and 2 backward "
        f"per MoE layer), expert gradients are all-reduced over the "
        f"{layout.data // layout.expert} replica(s) of one expert rank, the "
        f"rest over all {layout.data}.")
  if layout.pipeline > 1:
    bubble = schedules.bubble_fraction(layout.pipeline, layout.microbatches)
    lines.append(
        f"Pipeline bubble (p - 1) / (m + p - 1) = {100 * bubble:.0f}% with "
        f"p = {layout.pipeline}, m = {layout.microbatches} micro-batches "
        f"({layout.schedule}).")
  if layout.offload:
    lines.append(
        f"Offload keeps {units.format_bytes(pick.memory.host)} of optimizer "
        f"state per device in host memory, updated by the CPU.")
  return lines


def _nothing_fits(candidates, memory_per_device, devices):
  smallest = min(candidates, key=lambda c: c.memory.total)
  memory = smallest.memory
  lines = [
      f"Nothing fits in {units.format_bytes(memory_per_device)} per device "
      f"on {devices} devices. The smallest layout, {smallest.name}, needs "
      f"{units.format_bytes(memory.total)} on its fullest device "
      f"(parameters {units.format_bytes(memory.parameters)}, gradients "
      f"{units.format_bytes(memory.gradients)}, optimizer "
      f"{units.format_bytes(memory.optimizer)}, activations "
      f"{units.format_bytes(memory.activations)})."]
  # Model states and activations of a sharded layout shrink as 1/N at a
  # fixed global batch.
  needed = math.ceil(devices * memory.total / memory_per_device)
  lines.append(
      f"Try about {needed} devices or more (the smallest layout's memory "
      f"shrinks about as 1/N), a smaller batch (activations are "
      f"{units.format_bytes(memory.activations)} of it), mixed precision, or "
      f"devices with more memory. Rule: {candidates_lib.MEMORY_LIMITED}.")
  return "\n".join(lines)
