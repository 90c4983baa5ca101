"""Gradient accumulation under `DataParallelStrategy`: k=4 against k=1.

Trains benchmark 1's MLP under `tfpar.DataParallelStrategy(tfpar.Mesh(
{"data": 4}))` with Keras's `Adam(gradient_accumulation_steps=k)` for k = 4
and without accumulation (k = 1), the same global batch per micro-step,
in alternating runs in one process. Reports per configuration:

* the median time per micro-step (a `fit` step) and per optimizer step;
* the all-reduces the optimizer's update ran and their bytes, per
  optimizer step and per micro-step, counted at run time by the tests'
  independent counter (`tests/collective_count.py`): with accumulation
  the micro-steps between updates communicate nothing;
* the physical bound of a micro-step (`bounds.py`) and the ratio median
  micro-step time / bound.

Run from the repository root:

    python benchmarks/bench_accumulation.py
    python benchmarks/bench_accumulation.py --runs 5 --steps 100 \
        --output /tmp/accumulation.json
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "tests"))

import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
ACCUMULATION = 4


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=5, steps=100, skip_steps=8)
  common.add_global_batch_flag(parser, 256)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--classes", type=int, default=10)
  args = common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)
  if args.steps % ACCUMULATION or args.skip_steps % ACCUMULATION:
    parser.error(f"--steps and --skip-steps must be multiples of "
                 f"{ACCUMULATION}")
  return args


def physical_bound(args, devices, x, y, result, times):
  """Prints and returns the physical bound of a micro-step (see bounds.py):
  the MLP's matmul FLOPs at the global batch, and the bytes the counted
  all-reduces send per micro-step (a ring sends 2 (g-1)/g of the counted
  input bytes)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  batch = args.global_batch
  flops, _, _ = bounds.model_flops(
      lambda s: common.build_mlp(s, args), tf.constant(x[:batch]),
      tf.constant(y[:batch]))
  sent = 2 * (NUM_DEVICES - 1) / NUM_DEVICES
  machine = bounds.Machine((batch // NUM_DEVICES, args.hidden, args.hidden),
                           devices)
  return bounds.table(machine, {
      f"k={k} (micro-step)": (flops, result[k]["bytes_per_micro_step"] * sent,
                              times[k]) for k in times})


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  import collective_count  # pylint: disable=g-import-not-at-top
  x, y = common.synthetic_classification(args, args.global_batch * args.steps)
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": NUM_DEVICES}))
  models, counts = {}, {}
  for k in (1, ACCUMULATION):
    options = {"gradient_accumulation_steps": k} if k > 1 else {}
    with collective_count.update_all_reduces() as totals:
      models[k] = common.build_mlp(strategy, args, **options)
      models[k].fit(x, y, batch_size=args.global_batch, epochs=1,
                    steps_per_epoch=args.steps, shuffle=False, verbose=0)
    counts[k] = totals
  times = {k: [] for k in models}
  for run in range(args.runs):
    for k in common.alternating(models, run):
      timer = common.StepTimer(args.skip_steps)
      models[k].fit(x, y, batch_size=args.global_batch, epochs=1,
                    steps_per_epoch=args.steps, shuffle=False, verbose=0,
                    callbacks=[timer.callback])
      times[k].append(timer.step_time(args.steps))
  result = {}
  print(f"| k | ms / micro-step | ms / optimizer step | all-reduces / "
        f"optimizer step | bytes / optimizer step | bytes / micro-step |")
  print("|---|---|---|---|---|---|")
  for k in models:
    updates = args.steps // k
    row = {
        "micro_step_ms": 1e3 * statistics.median(times[k]),
        "all_reduces_per_update": counts[k]["executions"] / updates,
        "bytes_per_update": counts[k]["bytes"] / updates,
        "bytes_per_micro_step": counts[k]["bytes"] / args.steps,
    }
    result[k] = row
    print(f"| {k} | {row['micro_step_ms']:.2f} | "
          f"{k * row['micro_step_ms']:.2f} | "
          f"{row['all_reduces_per_update']:.0f} | "
          f"{row['bytes_per_update']:,.0f} | "
          f"{row['bytes_per_micro_step']:,.0f} |")
  of_medians, per_run = common.ratios(times[ACCUMULATION], times[1])
  print(f"\nmicro-step time k={ACCUMULATION} / k=1: {of_medians:.3f} "
        f"(ratio of medians), {per_run:.3f} (median per-run ratio)")
  result["ratio"] = {"of_medians": of_medians, "per_run": per_run}
  result["physical_bound"] = physical_bound(args, devices, x, y, result,
                                            times)
  common.write_json(args.output, result)


if __name__ == "__main__":
  main()
