"""Schedule traces: which stage ran which micro-batch, forward or backward,
and when, read from a TensorFlow profiler capture.

Every pipeline work item runs under the name scope
`tfpar_pipeline/stage{s}/microbatch{k}/{phase}`; the profiler records each
op it ran with its full name and its start and end. A work item spans its
first op's start to its last op's end, and is busy while one of its ops
runs (TF names the gradient ops of a
backward `gradient_tape/<forward op>`, so those count as backward). The measured bubble is the share of
the step's `p x makespan` device time in which a device ran none of its
ops; under the interleaved schedule a device runs several stages (stage `s`
on device `s % p`).
"""

import collections
import glob
import json
import os
import re

from tfpar._compat import runtime
from tfpar.pipeline import schedules

_WORK = re.compile(r"tfpar_pipeline/stage(\d+)/microbatch(\d+)/"
                   r"(forward|backward)")
_REPLICA = re.compile(r"replica_(\d+)/")
# Transfers wait for their peer (a receive's span is mostly waiting) and
# NoOps only order: neither is a stage's work.
_NOT_WORK = runtime.TRANSFER_OP_TYPES + ("NoOp",)

TraceEvent = collections.namedtuple(
    "TraceEvent", ["replica", "stage", "microbatch", "phase", "start_us",
                   "end_us", "busy"], defaults=(None,))
TraceEvent.__doc__ = """One work item: its span and the merged intervals
(`busy`, microseconds) in which its ops ran (the span when None)."""


def busy_intervals(event):
  """The intervals in which an event's ops ran."""
  return event.busy or ((event.start_us, event.end_us),)


class ScheduleTrace:
  """The work items of one pipelined step, with their times.

  Args:
    events: `TraceEvent`s (times in microseconds).
    pipeline_size: the devices of a pipeline, p (default: one per stage);
      stage `s` ran on device `s % p`.

  Example:

  >>> from tfpar.pipeline.trace import ScheduleTrace, TraceEvent
  >>> trace = ScheduleTrace([TraceEvent(0, 0, 0, "forward", 0, 1),
  ...                        TraceEvent(0, 1, 0, "forward", 1, 2)])
  >>> trace.bubble_fraction()
  0.5
  """

  def __init__(self, events, pipeline_size=None):
    # Ordered by end: a work item's first ops (variable reads, shapes) may
    # run early, its last ones wait for its data.
    self.events = sorted(events, key=lambda e: (e.end_us, e.stage))
    self.pipeline_size = pipeline_size or self.num_stages

  def device_of(self, stage):
    """The pipeline device (lane) that ran `stage`."""
    return stage % self.pipeline_size

  @property
  def num_stages(self):
    return 1 + max(e.stage for e in self.events)

  @property
  def replicas(self):
    return sorted({e.replica for e in self.events})

  def stage_order(self, stage, replica=0):
    """`(microbatch, phase)` of a stage's work in the order it ran."""
    return [(e.microbatch, e.phase) for e in self.events
            if e.stage == stage and e.replica == replica]

  def bubble_fraction(self, replica=None):
    """Measured idle share: 1 - busy device time / (p x makespan).

    Args:
      replica: one replica, or None for the mean over replicas.
    """
    if replica is None:
      values = [self.bubble_fraction(r) for r in self.replicas]
      return sum(values) / len(values)
    events = [e for e in self.events if e.replica == replica]
    start = min(e.start_us for e in events)
    makespan = max(e.end_us for e in events) - start
    p = self.pipeline_size
    busy = sum(_union_length([i for e in events if self.device_of(e.stage)
                              == d for i in busy_intervals(e)])
               for d in range(p))
    return 1.0 - busy / (p * makespan) if makespan else 0.0

  def summary(self, num_microbatches):
    """One line: measured bubble beside the formula (p - 1) / (v m + p - 1)."""
    p = self.pipeline_size
    v = self.num_stages // p
    formula = schedules.bubble_fraction(p, num_microbatches, v)
    return (f"pipeline bubble: measured {self.bubble_fraction():.3f}, "
            f"formula (p-1)/(v m+p-1) = {formula:.3f} "
            f"(p={p}, v={v}, m={num_microbatches})")

  def to_chrome_trace(self, path):
    """Writes the work items as Chrome trace events (chrome://tracing,
    Perfetto, TensorBoard's trace viewer), one thread per device."""
    events = [{
        "name": f"{e.phase[0].upper()}{e.microbatch}", "ph": "X",
        "pid": e.replica, "tid": self.device_of(e.stage), "ts": e.start_us,
        "dur": e.end_us - e.start_us,
        "args": {"stage": e.stage, "microbatch": e.microbatch,
                 "phase": e.phase}} for e in self.events]
    names = [{"name": "thread_name", "ph": "M", "pid": r, "tid": d,
              "args": {"name": ", ".join(
                  f"stage {s}" for s in range(d, self.num_stages,
                                              self.pipeline_size))}}
             for r in self.replicas for d in range(self.pipeline_size)]
    with open(path, "w") as f:
      json.dump({"traceEvents": names + events,
                 "displayTimeUnit": "ms"}, f)
    return path


def _merged(intervals):
  merged = []
  for lo, hi in sorted(intervals):
    if merged and lo <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
    else:
      merged.append((lo, hi))
  return merged


def _union_length(intervals):
  return sum(hi - lo for lo, hi in _merged(intervals))


def latest_xspace(log_dir):
  """The newest profiler capture under `log_dir` (plugins/profile/*/)."""
  files = glob.glob(os.path.join(log_dir, "plugins", "profile", "*",
                                 "*.xplane.pb"))
  if not files:
    raise ValueError(f"No profiler capture (*.xplane.pb) under {log_dir!r}.")
  return max(files, key=os.path.getmtime)


def read_xspace(path, pipeline_size=None):
  """The `ScheduleTrace` of the pipeline ops in a profiler capture.

  Args:
    path: an `*.xplane.pb` file.
    pipeline_size: the devices of a pipeline (default: one per stage).
  """
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  space = xplane_pb2.XSpace()
  with open(path, "rb") as f:
    space.ParseFromString(f.read())
  spans = {}
  for plane in space.planes:
    for line in plane.lines:
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        match = _WORK.search(name)
        if not match or name.rsplit(":", 1)[-1] in _NOT_WORK:
          continue
        stage, microbatch, phase = match.groups()
        if "gradient_tape/" in name[:match.start()]:
          phase = "backward"  # TF names gradient ops after their forward op.
        replica = _REPLICA.search(name)
        replica = replica.group(1) if replica else 0
        start = line.timestamp_ns * 1e-3 + event.offset_ps * 1e-6
        end = start + event.duration_ps * 1e-6
        key = (int(replica), int(stage), int(microbatch), phase)
        spans.setdefault(key, []).append((start, end))
  if not spans:
    raise ValueError(
        f"The profiler capture {path!r} has no pipeline work: profile a "
        f"step of a model trained under PipelineParallelStrategy.")
  return ScheduleTrace(
      [TraceEvent(*key, min(lo for lo, _ in ops), max(hi for _, hi in ops),
                  tuple(_merged(ops))) for key, ops in spans.items()],
      pipeline_size)
