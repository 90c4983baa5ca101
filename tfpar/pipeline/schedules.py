"""Pipeline schedules: the order each device runs its work in.

A schedule is, for every device of a replica's pipeline, a list of
`Work(stage, microbatch, phase)` items. `gpipe` runs all forwards, then all
backwards (GPipe); `1f1b` runs `p - s - 1` warm-up forwards on stage `s`,
then alternates one forward and one backward, then drains (PipeDream-Flush,
the 1F1B of Megatron and DeepSpeed), so at most `p - s` micro-batches of
activations are alive on stage `s` at once instead of `m`. Both have one
stage per device and the bubble fraction `(p - 1) / (m + p - 1)` of ideal
equal-cost stages.

`interleaved` is Megatron-LM's interleaved 1F1B: the model is cut into
`v x p` stages and device `d` runs the `v` stages `d, d + p, d + 2p, ...`
(its *virtual stages*), forwards in groups of `p` micro-batches through one
virtual stage after another, backwards in the reverse stage order, with
`2 (p - d - 1) + (v - 1) p` warm-up forwards on device `d`. Each stage is
`1/v` as long, so the bubble shrinks to `(p - 1) / (v m + p - 1)` of the
step (`(p - 1) / (v m)` of the ideal time, Megatron's figure), for more
point-to-point transfers (`v` times as many) and up to `(v + 1) / 2`-ish
times 1F1B's activations in flight on the first device.
"""

import collections

FORWARD = "forward"
BACKWARD = "backward"
SCHEDULES = ("gpipe", "1f1b", "interleaved")

Work = collections.namedtuple("Work", ["stage", "microbatch", "phase"])


def check_interleaving(schedule, virtual_stages, pipeline_size,
                       num_microbatches):
  """Raises a ValueError unless the settings make a valid schedule.

  Args:
    schedule: a name from `SCHEDULES`.
    virtual_stages: stages per device, v.
    pipeline_size: devices in a replica's pipeline, p.
    num_microbatches: m.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}. Received: "
                     f"schedule={schedule!r}")
  if (not isinstance(virtual_stages, int) or
      isinstance(virtual_stages, bool) or virtual_stages < 1):
    raise ValueError(f"virtual_stages must be a positive integer. Received: "
                     f"virtual_stages={virtual_stages!r}")
  if schedule != "interleaved" and virtual_stages != 1:
    raise ValueError(
        f"virtual_stages={virtual_stages} needs schedule='interleaved' (the "
        f"{schedule!r} schedule runs one stage per device).")
  if schedule == "interleaved":
    if virtual_stages < 2:
      raise ValueError(
          f"schedule='interleaved' needs virtual_stages >= 2 stages per "
          f"device (with 1 it is '1f1b'). Received: "
          f"virtual_stages={virtual_stages}")
    if num_microbatches is not None and num_microbatches % pipeline_size:
      raise ValueError(
          f"schedule='interleaved' runs micro-batches in groups of the "
          f"pipeline size: num_microbatches={num_microbatches} must be a "
          f"multiple of pipeline={pipeline_size} (as in Megatron-LM).")


def device_orders(schedule, pipeline_size, num_microbatches,
                  virtual_stages=1, backward=True):
  """The work of every device in the order it runs.

  Args:
    schedule: a name from `SCHEDULES`.
    pipeline_size: p, the devices of one replica's pipeline.
    num_microbatches: m.
    virtual_stages: v, the stages each device runs (`interleaved` only);
      stage `s` runs on device `s % p`.
    backward: False for inference (forwards only).

  Returns:
    A list of p lists of `Work`.

  Example:

  >>> from tfpar.pipeline.schedules import device_orders
  >>> [(w.stage, w.microbatch, w.phase[0])
  ...  for w in device_orders("interleaved", 2, 4, 2)[1]][:6]
  [(1, 0, 'f'), (1, 1, 'f'), (3, 0, 'f'), (3, 0, 'b'), (3, 1, 'f'), (3, 1, 'b')]
  """
  check_interleaving(schedule, virtual_stages, pipeline_size,
                     num_microbatches)
  if schedule != "interleaved":
    return stage_orders(schedule, pipeline_size, num_microbatches, backward)
  p, m, v = pipeline_size, num_microbatches, virtual_stages
  total = m * v

  def work(device, k, phase):
    chunk = (k % (p * v)) // p
    if phase == BACKWARD:
      chunk = v - 1 - chunk
    return Work(chunk * p + device, (k // (p * v)) * p + k % p, phase)

  def warmup(device):
    return total if m == p else min(2 * (p - device - 1) + (v - 1) * p, total)

  return _orders(p, total, work, warmup, backward)


def _orders(devices, count, work, warmup, backward):
  """Each device's `count` items of each phase (`work(device, k, phase)`):
  forwards only without `backward`; else `warmup(device)` forwards, then
  one forward and one backward in turn, then the remaining backwards
  (GPipe: a warm-up of every forward)."""
  orders = []
  for d in range(devices):
    forwards = [work(d, k, FORWARD) for k in range(count)]
    if not backward:
      orders.append(forwards)
      continue
    backwards = [work(d, k, BACKWARD) for k in range(count)]
    first = warmup(d)
    order = forwards[:first]
    for k in range(count - first):
      order += [forwards[first + k], backwards[k]]
    orders.append(order + backwards[count - first:])
  return orders


def stage_orders(schedule, num_stages, num_microbatches, backward=True):
  """The work of every stage in the order it runs, one stage per device
  (`gpipe` and `1f1b`; see `device_orders` for `interleaved`).

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
  if schedule not in ("gpipe", "1f1b"):
    raise ValueError(f"schedule must be 'gpipe' or '1f1b' for one stage per "
                     f"device. Received: schedule={schedule!r}")
  if schedule == "gpipe":
    warmup = lambda s: num_microbatches
  else:
    warmup = lambda s: min(num_stages - s - 1, num_microbatches)
  return _orders(num_stages, num_microbatches, Work, warmup, backward)


def build_order(orders):
  """One global order of all work respecting each device's order and the
  data dependencies between stages (the order ops are created in).

  Args:
    orders: the work of every device, as `device_orders` gives.

  Raises:
    ValueError: the per-device orders deadlock (cannot happen for the
      built-in schedules).
  """
  num_stages = 1 + max(w.stage for order in orders for w in order)
  positions = [0] * len(orders)
  done = set()
  result = []
  total = sum(len(o) for o in orders)
  while len(result) < total:
    progressed = False
    for d, order in enumerate(orders):
      if positions[d] == len(order):
        continue
      work = order[positions[d]]
      s = work.stage
      if work.phase == FORWARD:
        ready = s == 0 or Work(s - 1, work.microbatch, FORWARD) in done
      else:
        ready = Work(s, work.microbatch, FORWARD) in done and (
            s == num_stages - 1 or
            Work(s + 1, work.microbatch, BACKWARD) in done)
      if ready:
        done.add(work)
        result.append(work)
        positions[d] += 1
        progressed = True
    if not progressed:
      raise ValueError(f"Pipeline schedule deadlocks after {result}.")
  return result


def peak_in_flight(order):
  """The most micro-batch stage activations whose forward ran and backward
  did not, on one device's order (activations alive at once)."""
  alive = peak = 0
  for work in order:
    alive += 1 if work.phase == FORWARD else -1
    peak = max(peak, alive)
  return peak


def bubble_fraction(num_stages, num_microbatches, virtual_stages=1):
  """The idle fraction of an ideal pipeline: (p - 1) / (v m + p - 1), with
  p devices, m micro-batches and v stages per device (1 but for
  `interleaved`)."""
  return (num_stages - 1) / (virtual_stages * num_microbatches +
                             num_stages - 1)
