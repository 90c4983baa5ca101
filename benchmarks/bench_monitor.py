"""`tfpar.TrainingMonitor`'s own cost: step time with it against without it.

Trains benchmark 1's MLP under `tfpar.DataParallelStrategy` on 4 virtual
CPUs, in alternating runs in one process: `fit` with only the step timer,
and `fit` with the timer and a `TrainingMonitor(every=k)` writing a CSV
and TensorBoard events (its whole work: Keras logs, memory per device, the
files). The monitor's one-off work (reading the traced step, measuring
the CPU's matmul rate) happens in a warm-up fit before the timed runs.
Reports the median step time of each, their ratio (the monitor's cost in %
of step time), the time spent inside the monitor's own hooks per step (a
direct count, which the load of a shared machine does not blur as it does
the ratio) and the monitor's own numbers from the last run.

Run from the repository root:

    python benchmarks/bench_monitor.py
    python benchmarks/bench_monitor.py --runs 21 --steps 200 --every 10 \
        --csv /tmp/monitor.csv --output /tmp/monitor.json
    tfpar monitor plot /tmp/monitor.csv -o docs/monitor.png
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_epoch_end",
          "on_train_end")


def timed_monitor(**kwargs):
  """A `TrainingMonitor` that adds the seconds spent in its hooks to
  `.hook_seconds` and counts the steps in `.hook_steps`."""

  class Timed(tfpar.TrainingMonitor):
    hook_seconds = 0.0
    hook_steps = 0

  def timed(name):
    original = getattr(tfpar.TrainingMonitor, name)

    def hook(self, *args, **kwargs):
      start = time.perf_counter()
      try:
        return original(self, *args, **kwargs)
      finally:
        self.hook_seconds += time.perf_counter() - start
        self.hook_steps += name == "on_train_batch_end"
    return hook

  for name in _HOOKS:
    setattr(Timed, name, timed(name))
  return Timed(**kwargs)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=11, steps=100, skip_steps=5)
  common.add_global_batch_flag(parser, 256)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--every", type=int, default=10,
                      help="steps between the monitor's reports")
  parser.add_argument("--csv", default=None,
                      help="keep the monitor's CSV here (default: a "
                      "temporary directory); plot it with `tfpar monitor "
                      "plot`")
  return common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)


def main(argv=None):
  args = parse_args(argv)
  tfpar.configure_virtual_cpus(NUM_DEVICES)
  folder = tempfile.mkdtemp()
  x, y = common.synthetic_classification(args, args.global_batch * args.steps)
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": NUM_DEVICES}))
  model = common.build_mlp(strategy, args)
  monitor = timed_monitor(
      every=args.every, csv_path=args.csv or os.path.join(folder, "run.csv"),
      log_dir=os.path.join(folder, "logs"))

  def fit(callbacks):
    model.fit(x, y, batch_size=args.global_batch, epochs=1,
              steps_per_epoch=args.steps, shuffle=False, verbose=0,
              callbacks=callbacks)

  fit([monitor])  # Warm-up: traces the step, reads it, measures the peak.
  monitor.hook_seconds, monitor.hook_steps = 0.0, 0

  def time_once(name):
    timer = common.StepTimer(args.skip_steps)
    fit([timer.callback] + ([monitor] if name == "monitor" else []))
    return timer.step_time(args.steps)

  times = common.alternating_times(("plain", "monitor"), args.runs,
                                   time_once)
  of_medians, per_run = common.ratios(times["monitor"], times["plain"])
  last = monitor.last
  hook_ms = 1e3 * monitor.hook_seconds / monitor.hook_steps
  result = {
      "ms_per_step": {name: 1e3 * statistics.median(t)
                      for name, t in times.items()},
      "cost_percent": {"of_medians": 100 * (of_medians - 1),
                       "per_run": 100 * (per_run - 1)},
      "hook_ms_per_step": hook_ms,
      "hook_percent_of_step": 100 * hook_ms / (
          1e3 * statistics.median(times["plain"])),
      "monitor": last and {key: last[key] for key in (
          "flops_per_step", "samples_per_sec", "flops_per_sec",
          "peak_flops_per_sec", "mfu", "all-reduce_bytes",
          "all-reduce_busbw")},
      "every": args.every, "runs": args.runs, "steps": args.steps,
  }
  print(f"| | ms / step (median of {args.runs}) |\n|---|---|")
  for name, ms in result["ms_per_step"].items():
    print(f"| {name} | {ms:.3f} |")
  print(f"\nmonitor cost: {result['cost_percent']['of_medians']:+.2f}% "
        f"(ratio of medians), {result['cost_percent']['per_run']:+.2f}% "
        f"(median per-run ratio), every={args.every}")
  print(f"time inside the monitor's hooks: {hook_ms:.4f} ms per step, "
        f"{result['hook_percent_of_step']:.2f}% of the plain step")
  print("monitor's last report:", result["monitor"])
  common.write_json(args.output, result)


if __name__ == "__main__":
  main()
