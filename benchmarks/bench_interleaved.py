"""Interleaved 1F1B against 1F1B: measured bubble vs the formulas, and
peak activation memory, for `tfpar.PipelineParallelStrategy`.

Part 1, bubble. For p in {2, 4} pipeline devices (one process, 4 virtual
CPUs, mesh data 4/p x pipeline p) and m in {4, 8} micro-batches, the same
model is trained under `schedule="1f1b"` (p stages of one block) and
`schedule="interleaved", virtual_stages=2` (2p stages of half a block):
each block is a Dense layer and a *timed* layer that waits `--forward-ms`
(half that in each half block) in its forward and twice that in its
backward (bench_pipeline.py's timed layer: stages really overlap although
this machine has 2 cores). `tfpar.PipelineTrace` profiles `--runs` steps
after 2 warm-up steps; the measured bubble is 1 - busy / (p x makespan)
per device (a device's virtual stages share its lane), median of the
steps, beside (p - 1) / (m + p - 1) and (p - 1) / (v m + p - 1).

Part 2, activation memory. p = 4 (data 1), micro-batches of `--memory-rows`
rows, m in {4, 8, 16}: 16 Dense layers of `--memory-width` as 4 stages of
4 (1F1B) or 8 stages of 2 (interleaved, v = 2). TF's CPU allocator peak
during one step (after 2 warm-up steps) minus the bytes in use before it,
as in bench_pipeline.py.

With `--picture PATH`, the swimlane picture of one profiled interleaved
step (p = 4, m = 8) is copied to PATH.

Run from the repository root:

    python benchmarks/bench_interleaved.py
    python benchmarks/bench_interleaved.py --runs 3 --picture /tmp/il.png
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_pipeline  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
VIRTUAL = 2
SCHEDULES = ("1f1b", "interleaved")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=5,
                      help="profiled steps per configuration (median)")
  parser.add_argument("--forward-ms", type=float, default=20.0,
                      help="forward wait of a whole block")
  parser.add_argument("--memory-rows", type=int, default=256)
  parser.add_argument("--memory-width", type=int, default=512)
  parser.add_argument("--picture", help="copy one interleaved swimlane "
                      "picture (p=4, m=8) here")
  parser.add_argument("--output", help="also write the results as JSON")
  return parser.parse_args(argv)


def strategy_for(p, m, schedule, data=None):
  mesh = tfpar.Mesh({"data": data or NUM_DEVICES // p, "pipeline": p})
  extra = {"virtual_stages": VIRTUAL} if schedule == "interleaved" else {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return tfpar.PipelineParallelStrategy(mesh, num_microbatches=m,
                                          schedule=schedule, **extra)


def stages(p, schedule):
  return p * VIRTUAL if schedule == "interleaved" else p


def measure_bubble(keras, timed, p, m, schedule, args, picture=None):
  """Bubble fraction of each profiled step."""
  strategy = strategy_for(p, m, schedule)
  with strategy.scope():
    model = bench_pipeline.chain(keras, stages(p, schedule), 64,
                                 timed=timed[schedule])
    model.compile(optimizer="sgd", loss="mse")
  traces = bench_pipeline.profiled_traces(
      model, 64, 8 * m * strategy.num_replicas_in_sync, args.runs)
  if picture:
    shutil.copy(os.path.join(traces[-1].log_dir, "schedule.png"), picture)
  return [t.trace.bubble_fraction() for t in traces]


def measure_memory(keras, tf, m, schedule, args):
  p = 4
  strategy = strategy_for(p, m, schedule, data=1)
  count = stages(p, schedule)
  with strategy.scope():
    model = bench_pipeline.chain(keras, count, args.memory_width,
                                 layers_per_block=16 // count)
    model.compile(optimizer="sgd", loss="mse")
  return bench_pipeline.step_peak_bytes(tf, model, args.memory_rows * m,
                                        args.memory_width)


def main(argv=None):
  args = parse_args(argv)
  tfpar.configure_virtual_cpus(NUM_DEVICES)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_inter_op_parallelism_threads(16)
  import keras  # pylint: disable=g-import-not-at-top
  timed = {"1f1b": bench_pipeline.timed_layer(keras, tf, args.forward_ms),
           "interleaved": bench_pipeline.timed_layer(
               keras, tf, args.forward_ms / VIRTUAL)}
  results = {"bubble": [], "memory": []}
  print(f"\n### Bubble, timed blocks ({args.forward_ms:g} ms forward, "
        f"{2 * args.forward_ms:g} ms backward per block and micro-batch; "
        f"interleaved v = {VIRTUAL}: half blocks), median of {args.runs} "
        f"profiled steps\n")
  print("| p | m | 1F1B formula | 1F1B measured | interleaved formula | "
        "interleaved measured |")
  print("|---:|---:|---:|---:|---:|---:|")
  for p in (2, 4):
    for m in (4, 8):
      row = {"p": p, "m": m,
             "1f1b formula": tfpar.pipeline.bubble_fraction(p, m),
             "interleaved formula": tfpar.pipeline.bubble_fraction(
                 p, m, VIRTUAL)}
      for schedule in SCHEDULES:
        picture = (args.picture if (p, m, schedule) == (4, 8, "interleaved")
                   else None)
        values = measure_bubble(keras, timed, p, m, schedule, args, picture)
        row[schedule] = statistics.median(values)
        print(f"p={p} m={m} {schedule}: {values}", file=sys.stderr)
      results["bubble"].append(row)
      print(f"| {p} | {m} | {row['1f1b formula']:.3f} | {row['1f1b']:.3f} | "
            f"{row['interleaved formula']:.3f} | {row['interleaved']:.3f} |")

  print(f"\n### Peak activation memory, p = 4, {args.memory_rows} rows per "
        f"micro-batch, 16 x Dense {args.memory_width} (MiB)\n")
  print("| m | 1F1B | interleaved (v = 2) | interleaved / 1F1B |")
  print("|---:|---:|---:|---:|")
  for m in (4, 8, 16):
    row = {"m": m}
    for schedule in SCHEDULES:
      row[schedule] = measure_memory(keras, tf, m, schedule, args)
    results["memory"].append(row)
    ratio = (f"{row['interleaved'] / row['1f1b']:.2f}" if row["1f1b"]
             else "n/a (too small to measure)")
    print(f"| {m} | {row['1f1b'] / 2**20:.1f} | "
          f"{row['interleaved'] / 2**20:.1f} | {ratio} |")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
