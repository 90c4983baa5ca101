"""One report of `TrainingMonitor`: the numbers of the last k steps as a
flat dict (the CSV row and TensorBoard's scalars), and the few of them
Keras's progress bar shows."""

from tfpar.monitor import bandwidth


def short_device(device):
  """`/job:worker/replica:0/task:1/device:GPU:0` -> `task1/GPU:0` (the task
  only when not 0).

  Example:

  >>> short_device("/job:localhost/replica:0/task:0/device:CPU:3")
  'CPU:3'
  """
  task = device.split("/task:")[1].split("/")[0] if "/task:" in device else "0"
  name = device.rpartition("device:")[2] or device
  return name if task == "0" else f"task{task}/{name}"


def _ratio(numerator, denominator):
  if numerator is None or not denominator:
    return None
  return numerator / denominator


def build(step, step_time, samples, tokens, count, peak, collectives_known,
          memory):
  """The report's numbers (None: unknown).

  Args:
    step: the global step the report ends at.
    step_time: mean seconds per step over the reported steps.
    samples: samples per step (all replicas), or None.
    tokens: tokens per step, or None.
    count: the step's `step_graph.StepCount`, or None (FLOPs unknown).
    peak: peak FLOP/s of the step's devices together, or None.
    collectives_known: whether the step's communication is all in `count`'s
      collectives (False: a stock strategy's copies).
    memory: (source, {device: (current, peak or None)}).

  Returns:
    A dict: `step`, `step_time_s`, `samples_per_sec`, `tokens_per_sec`,
    `flops_per_step`, `flops_per_sec`, `peak_flops_per_sec`, `mfu`;
    `<kind>_bytes`, `<kind>_algbw`, `<kind>_busbw` (bytes/s over the step
    time) for every collective kind; `memory_source`; and
    `memory_current:<device>`, `memory_peak:<device>`.

  Example:

  >>> row = build(10, 0.5, 64, None, None, None, False, ("variables", {}))
  >>> row["samples_per_sec"], row["mfu"], row["all-reduce_bytes"]
  (128.0, None, None)
  """
  flops = None if count is None else count.total_flops
  flops_per_sec = _ratio(flops, step_time)
  row = {"step": step, "step_time_s": step_time,
         "samples_per_sec": _ratio(samples, step_time),
         "tokens_per_sec": _ratio(tokens, step_time),
         "flops_per_step": flops, "flops_per_sec": flops_per_sec,
         "peak_flops_per_sec": peak, "mfu": _ratio(flops_per_sec, peak)}
  totals = count.bytes_by_kind() if count is not None else {}
  for kind in bandwidth.KINDS:
    size, bus = totals.get(kind, (0, 0))
    if count is None or not collectives_known:
      size = bus = None
    row[f"{kind}_bytes"] = size
    row[f"{kind}_algbw"] = _ratio(size, step_time)
    row[f"{kind}_busbw"] = _ratio(bus, step_time)
  source, per_device = memory
  row["memory_source"] = source
  for device, (current, peak_bytes) in sorted(per_device.items()):
    row[f"memory_current:{short_device(device)}"] = current
    row[f"memory_peak:{short_device(device)}"] = peak_bytes
  return row


def progress_values(row):
  """The numbers for Keras's logs (so its progress bar shows them), in
  readable units; unknown ones are left out.

  Example:

  >>> progress_values({"step_time_s": 0.02, "samples_per_sec": 3200.0,
  ...                  "mfu": None, "all-reduce_busbw": 2e9,
  ...                  "all-gather_busbw": None})
  {'step_ms': 20.0, 'samples_per_sec': 3200.0, 'all_reduce_busbw_GBps': 2.0}
  """
  values = {}

  def put(name, value, scale=1.0):
    if value is not None:
      values[name] = value * scale

  put("step_ms", row.get("step_time_s"), 1e3)
  put("samples_per_sec", row.get("samples_per_sec"))
  put("tokens_per_sec", row.get("tokens_per_sec"))
  put("tflops_per_sec", row.get("flops_per_sec"), 1e-12)
  put("mfu", row.get("mfu"))
  for kind in bandwidth.KINDS:
    bus = row.get(f"{kind}_busbw")
    if bus:
      put(f"{kind.replace('-', '_')}_busbw_GBps", bus, 1e-9)
  currents = [v for k, v in row.items()
              if k.startswith("memory_current:") and v is not None]
  peaks = [v for k, v in row.items()
           if k.startswith("memory_peak:") and v is not None]
  if currents:
    put("memory_MB", max(currents), 1e-6)
  if peaks:
    put("memory_peak_MB", max(peaks), 1e-6)
  return values
