"""Pipeline schedules: the order each stage runs its work in.

A schedule is, for every stage, a list of `Work(stage, microbatch, phase)`
items. `gpipe` runs all forwards, then all backwards (GPipe); `1f1b` runs
`p - s - 1` warm-up forwards on stage `s`, then alternates one forward and
one backward, then drains (PipeDream-Flush, the 1F1B of Megatron and
DeepSpeed), so at most `p - s` micro-batches of activations are alive on
stage `s` at once instead of `m`. Both have the bubble fraction
`(p - 1) / (m + p - 1)` of ideal equal-cost stages.
"""

import collections

FORWARD = "forward"
BACKWARD = "backward"
SCHEDULES = ("gpipe", "1f1b")

Work = collections.namedtuple("Work", ["stage", "microbatch", "phase"])


def stage_orders(schedule, num_stages, num_microbatches, backward=True):
  """The work of every stage in the order it runs.

  Args:
    schedule: `"gpipe"` or `"1f1b"`.
    num_stages: p.
    num_microbatches: m.
    backward: False for inference (forwards only, in micro-batch order).

  Returns:
    A list of p lists of `Work`.

  Example:

  >>> from tfpar.pipeline.schedules import stage_orders
  >>> [(w.microbatch, w.phase[0]) for w in stage_orders("1f1b", 2, 3)[0]]
  [(0, 'f'), (1, 'f'), (0, 'b'), (2, 'f'), (1, 'b'), (2, 'b')]
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}. Received: "
                     f"schedule={schedule!r}")
  orders = []
  for s in range(num_stages):
    forwards = [Work(s, k, FORWARD) for k in range(num_microbatches)]
    if not backward:
      orders.append(forwards)
      continue
    backwards = [Work(s, k, BACKWARD) for k in range(num_microbatches)]
    if schedule == "gpipe":
      orders.append(forwards + backwards)
      continue
    warmup = min(num_stages - s - 1, num_microbatches)
    order = forwards[:warmup]
    for k in range(num_microbatches - warmup):
      order += [forwards[warmup + k], backwards[k]]
    order += backwards[num_microbatches - warmup:]
    orders.append(order)
  return orders


def build_order(orders):
  """One global order of all work respecting each stage's order and the
  data dependencies between stages (the order ops are created in).

  Raises:
    ValueError: the per-stage orders deadlock (cannot happen for the
      built-in schedules).
  """
  num_stages = len(orders)
  positions = [0] * num_stages
  done = set()
  result = []
  total = sum(len(o) for o in orders)
  while len(result) < total:
    progressed = False
    for s in range(num_stages):
      if positions[s] == len(orders[s]):
        continue
      work = orders[s][positions[s]]
      if work.phase == FORWARD:
        ready = s == 0 or Work(s - 1, work.microbatch, FORWARD) in done
      else:
        ready = Work(s, work.microbatch, FORWARD) in done and (
            s == num_stages - 1 or
            Work(s + 1, work.microbatch, BACKWARD) in done)
      if ready:
        done.add(work)
        result.append(work)
        positions[s] += 1
        progressed = True
    if not progressed:
      raise ValueError(f"Pipeline schedule deadlocks after {result}.")
  return result


def peak_in_flight(order):
  """The most micro-batches whose forward ran and backward did not, on one
  stage's order (activations alive at once)."""
  alive = peak = 0
  for work in order:
    alive += 1 if work.phase == FORWARD else -1
    peak = max(peak, alive)
  return peak


def bubble_fraction(num_stages, num_microbatches):
  """The idle fraction of an ideal pipeline: (p - 1) / (m + p - 1)."""
  return (num_stages - 1) / (num_microbatches + num_stages - 1)
