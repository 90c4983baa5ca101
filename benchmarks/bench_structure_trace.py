"""Preparing a model for tensor parallelism: one structure trace against
one per caller.

Before a tensor-parallel model's first step, tfpar traces the whole model
(a throw-away `tf.function`, nothing runs) to find its attention and MLPs.
The plan, the MLP pairing and, under a pipeline of tensor-parallel
stages, the column -> row pairs (one more per row layer) each traced it
on their own; now they share one trace (`structure.shared_trace`). This
script times both in alternating runs in one process: "per caller" runs
with `shared_trace` replaced by a context that shares nothing. For each
layout (data 2 x tensor 2, and pipeline 2 x tensor 2 with 2
microbatches) and each way, a fresh GPT (benchmark 3's) is built and
compiled under the strategy and predicts one batch: CPU seconds of all
of it (preparing the model included) and of the structure traces alone,
and how many there were.

Run from the repository root:

    python benchmarks/bench_structure_trace.py
    python benchmarks/bench_structure_trace.py --runs 7 \
        --output /tmp/structure_trace.json
"""

import argparse
import contextlib
import os
import resource
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_tensor_vs_data_parallel as gpt_benchmark  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
LAYOUTS = {
    "data 2 x tensor 2": {"data": 2, "tensor": 2},
    "pipeline 2 x tensor 2": {"data": 1, "pipeline": 2, "tensor": 2},
}
WAYS = ("one trace", "per caller")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--output", help="also write the results as JSON here")
  common.add_gpt_flags(parser)
  args = parser.parse_args(argv)
  if args.runs < 1:
    parser.error(f"--runs must be at least 1, got {args.runs}")
  return args


def _cpu_seconds():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


class _TraceCounter:
  """Counts the whole-model structure traces and their CPU seconds."""

  def __init__(self, structure):
    self.count, self.seconds = 0, 0.0
    trace = structure._trace_calls  # pylint: disable=protected-access

    def counting(model, layers):
      self.count += 1
      start = _cpu_seconds()
      try:
        return trace(model, layers)
      finally:
        self.seconds += _cpu_seconds() - start

    structure._trace_calls = counting  # pylint: disable=protected-access


def build_and_predict(args, mesh, counter):
  """(CPU s of building, compiling and first predicting, CPU s and count
  of the structure traces among them)."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  strategy = (tfpar.PipelineParallelStrategy(tfpar.Mesh(mesh),
                                             num_microbatches=2)
              if "pipeline" in mesh else
              tfpar.TensorParallelStrategy(tfpar.Mesh(mesh)))
  counter.count, counter.seconds = 0, 0.0
  start = _cpu_seconds()
  with strategy.scope():
    model = gpt_benchmark.gpt(args)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  tokens = np.random.default_rng(args.seed).integers(
      0, args.vocab, size=(8, args.sequence)).astype("int32")
  model.predict(tokens, batch_size=8, verbose=0)
  return _cpu_seconds() - start, counter.seconds, counter.count


def main(argv=None):
  args = parse_args(argv)
  tfpar.configure_virtual_cpus(NUM_DEVICES)
  from tfpar.tensor_parallel import structure  # pylint: disable=g-import-not-at-top
  counter = _TraceCounter(structure)
  shared = structure.shared_trace
  results = {}
  for layout, mesh in LAYOUTS.items():
    build_and_predict(args, mesh, counter)  # Warm-up: imports, first traces.
    runs = {way: [] for way in WAYS}
    for run in range(args.runs):
      for way in common.alternating(WAYS, run):
        structure.shared_trace = (shared if way == "one trace" else
                                  lambda model: contextlib.nullcontext())
        runs[way].append(build_and_predict(args, mesh, counter))
        seconds, traced, count = runs[way][-1]
        print(f"{layout}, run {run + 1}/{args.runs}, {way}: build to predict "
              f"{seconds:.2f} CPU s, {count} structure traces "
              f"{traced:.2f} CPU s", file=sys.stderr)
    structure.shared_trace = shared
    median = lambda way, i: statistics.median(r[i] for r in runs[way])
    results[layout] = {
        way: {"build_to_predict_cpu_s": median(way, 0),
              "structure_trace_cpu_s": median(way, 1),
              "structure_traces": runs[way][0][2]}
        for way in WAYS}
    results[layout]["predict_ratio_one_over_per_caller"] = (
        common.ratios([r[0] for r in runs["one trace"]],
                      [r[0] for r in runs["per caller"]]))
  for layout, result in results.items():
    one, each = result["one trace"], result["per caller"]
    print(f"{layout}: structure traces {each['structure_traces']} -> "
          f"{one['structure_traces']}, {each['structure_trace_cpu_s']:.2f} "
          f"-> {one['structure_trace_cpu_s']:.2f} CPU s; build to predict "
          f"{each['build_to_predict_cpu_s']:.2f} -> "
          f"{one['build_to_predict_cpu_s']:.2f} CPU s (ratio of medians "
          f"{result['predict_ratio_one_over_per_caller'][0]:.3f}, median "
          f"per-run ratio {result['predict_ratio_one_over_per_caller'][1]:.3f})")
  common.write_json(args.output, {"args": vars(args), "results": results})


if __name__ == "__main__":
  main()
