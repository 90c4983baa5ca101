"""Pipeline bubble measured vs the formula, and peak activation memory of
1F1B vs GPipe, for `tfpar.PipelineParallelStrategy`.

Part 1, bubble. For p in {2, 4} pipeline stages (one process, 4 virtual
CPUs, mesh data 4/p x pipeline p) and m in {1, 2, 4, 8} micro-batches,
both schedules, a chain of p blocks is trained with `model.fit` and
`tfpar.PipelineTrace` profiles `--runs` steps (after 2 warm-up steps).
Each block is a Dense layer followed by a *timed* layer that waits
`--forward-ms` in its forward and twice that in its backward (a stateless
`tf.numpy_function` sleeping, so stages really overlap although this
machine has 2 cores; the schedule, not the CPU count, is measured). The
measured bubble is 1 - busy / (p x makespan) of each profiled step, from
the op timelines of the TF profiler (`ScheduleTrace.bubble_fraction`);
the table gives its median beside (p - 1) / (m + p - 1).

Part 1b, the same with real compute only (Dense layers of `--width`, no
timed layer) for p = 2 (data 2): the 4 stage devices share the 2 cores,
and per-op overheads count as idle time, so expect more than the formula.

Part 1c, the physical bound (`bounds.py`) of each step of part 1b beside
its makespan (first op to last in the profiler's timeline), and the ratio.

Part 2, activation memory. p = 4 (data 1), micro-batches of a fixed
`--memory-rows` rows, m in {4, 8, 16}: the batch grows with m. After 2
warm-up steps, TF's CPU allocator peak is reset and one step is run;
`tf.config.experimental.get_memory_info("CPU:0")["peak"]` (process-wide:
the 4 virtual CPUs share one allocator) minus the bytes in use before the
step is the step's peak of activations (and gradients, the same for both
schedules). 1F1B keeps at most p micro-batches of activations per stage,
GPipe m.

Run from the repository root:

    python benchmarks/bench_pipeline.py
    python benchmarks/bench_pipeline.py --runs 3 --output /tmp/pp.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top

import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
SCHEDULES = ("gpipe", "1f1b")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=5,
                      help="profiled steps per configuration (median)")
  parser.add_argument("--forward-ms", type=float, default=20.0)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--rows", type=int, default=64,
                      help="rows per micro-batch in part 1")
  parser.add_argument("--memory-rows", type=int, default=256)
  parser.add_argument("--memory-width", type=int, default=512)
  parser.add_argument("--output", help="also write the results as JSON")
  return parser.parse_args(argv)


def timed_layer(keras, tf, forward_ms):
  """A Keras layer that waits forward_ms forward and 2x backward."""

  def wait(seconds):
    def fn(value):
      time.sleep(seconds)
      return value
    return fn

  @tf.custom_gradient
  def timed(x):
    y = tf.numpy_function(wait(forward_ms / 1e3), [x], x.dtype,
                          stateful=False)
    y.set_shape(x.shape)

    def grad(dy):
      g = tf.numpy_function(wait(2 * forward_ms / 1e3), [dy], dy.dtype,
                            stateful=False)
      g.set_shape(dy.shape)
      return g
    return y, grad

  class Timed(keras.layers.Layer):

    def call(self, x):
      return timed(x)

  return Timed


def chain(keras, blocks, width, layers_per_block=1, timed=None):
  inputs = keras.Input((width,))
  x = inputs
  for b in range(blocks):
    for i in range(layers_per_block):
      x = keras.layers.Dense(width, activation="relu",
                             name=f"block{b}_dense{i}")(x)
    if timed is not None:
      x = timed(name=f"block{b}_timed")(x)
  return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def strategy_for(p, m, schedule, data=None):
  mesh = tfpar.Mesh({"data": data or NUM_DEVICES // p, "pipeline": p})
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # m < p warns.
    return tfpar.PipelineParallelStrategy(mesh, num_microbatches=m,
                                          schedule=schedule)


def measure_bubble(keras, p, m, schedule, args, timed, spans=None):
  """Bubble fraction of each profiled step; their makespans (seconds) are
  appended to `spans` when given."""
  strategy = strategy_for(p, m, schedule)
  width = args.width if timed is None else 64
  with strategy.scope():
    model = chain(keras, p, width, timed=timed)
    model.compile(optimizer="sgd", loss="mse")
  traces = profiled_traces(model, width, args.rows * m *
                           strategy.num_replicas_in_sync, args.runs)
  if spans is not None:
    spans.extend(makespans(traces))
  return [t.trace.bubble_fraction() for t in traces]


def profiled_traces(model, width, batch, runs):
  """Fits `model` on `2 + runs` batches of `batch` random rows, the last
  `runs` steps each profiled by a `tfpar.PipelineTrace`; returns those
  callbacks."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch * (2 + runs), width)).astype("float32")
  log_root = tempfile.mkdtemp(prefix="tfpar_bench_pp_")
  traces = [tfpar.PipelineTrace(os.path.join(log_root, str(r)), step=2 + r,
                                verbose=False) for r in range(runs)]
  model.fit(x, x[:, :1], batch_size=batch, epochs=1, verbose=0,
            callbacks=traces, shuffle=False)
  return traces


def makespans(traces):
  """Seconds from the first op to the last of each profiled step."""
  return [(max(e.end_us for e in t.trace.events) -
           min(e.start_us for e in t.trace.events)) / 1e6 for t in traces]


def measure_memory(keras, tf, m, schedule, args):
  p = 4
  strategy = strategy_for(p, m, schedule, data=1)
  with strategy.scope():
    model = chain(keras, p, args.memory_width, layers_per_block=4)
    model.compile(optimizer="sgd", loss="mse")
  return step_peak_bytes(tf, model, args.memory_rows * m, args.memory_width)


def step_peak_bytes(tf, model, batch, width):
  """TF's CPU allocator peak during one step of `model` (after 2 warm-up
  steps) minus the bytes in use before it."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch * 2, width)).astype("float32")
  y = x[:, :1]
  model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
  tf.config.experimental.reset_memory_stats("CPU:0")
  before = tf.config.experimental.get_memory_info("CPU:0")["current"]
  model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
  return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def physical_bound(keras, tf, args, devices, spans):
  """Prints and returns the physical bound of each real-compute step of
  part 1b (see bounds.py) beside its makespan, from the first op to the
  last in the profiler's timeline (median of the profiled steps). FLOPs:
  the chain's matmuls on the step's whole batch (data 2 x m micro-batches
  of `--rows`); bytes: each micro-batch's activation forward and its
  gradient backward across the p - 1 = 1 stage boundary, per replica."""
  import bounds  # pylint: disable=g-import-not-at-top
  p, data = 2, NUM_DEVICES // 2
  machine = bounds.Machine((args.rows, args.width, args.width), devices)
  rows = {}
  for (m, schedule), seconds in spans.items():
    batch = args.rows * m * data
    x = tf.zeros((batch, args.width))
    flops, _, _ = bounds.model_flops(
        lambda s: compiled_chain(keras, s, p, args.width), x, x[:, :1])
    nbytes = 2 * (p - 1) * data * m * args.rows * args.width * 4
    rows[f"p=2 m={m} {schedule}"] = (flops, nbytes, seconds)
  print("\n### Physical bound of the real-compute steps (makespan as the "
        "step time)")
  return bounds.table(machine, rows)


def compiled_chain(keras, strategy, p, width):
  with strategy.scope():
    model = chain(keras, p, width)
    model.compile(optimizer="sgd", loss="mse")
  return model


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Enough executor threads for every stage's wait to overlap.
  tf.config.threading.set_inter_op_parallelism_threads(16)
  import keras  # pylint: disable=g-import-not-at-top
  timed = timed_layer(keras, tf, args.forward_ms)
  results = {"bubble": [], "bubble_compute": [], "memory": []}

  print(f"\n### Bubble, timed stages ({args.forward_ms:g} ms forward, "
        f"{2 * args.forward_ms:g} ms backward per stage and micro-batch), "
        f"median of {args.runs} profiled steps\n")
  print("| p | m | formula (p-1)/(m+p-1) | GPipe measured | "
        "1F1B measured |")
  print("|---:|---:|---:|---:|---:|")
  for p in (2, 4):
    for m in (1, 2, 4, 8):
      row = {"p": p, "m": m,
             "formula": tfpar.pipeline.bubble_fraction(p, m)}
      for schedule in SCHEDULES:
        values = measure_bubble(keras, p, m, schedule, args, timed)
        row[schedule] = statistics.median(values)
        print(f"p={p} m={m} {schedule}: {values}", file=sys.stderr)
      results["bubble"].append(row)
      print(f"| {p} | {m} | {row['formula']:.3f} | {row['gpipe']:.3f} | "
            f"{row['1f1b']:.3f} |")

  print(f"\n### Bubble, real compute (Dense {args.width}, "
        f"{args.rows} rows per micro-batch), p = 2, median of {args.runs}"
        f" profiled steps\n")
  print("| p | m | formula | GPipe measured | 1F1B measured |")
  print("|---:|---:|---:|---:|---:|")
  spans = {}
  for m in (1, 2, 4, 8):
    row = {"p": 2, "m": m, "formula": tfpar.pipeline.bubble_fraction(2, m)}
    for schedule in SCHEDULES:
      spans[(m, schedule)] = []
      row[schedule] = statistics.median(
          measure_bubble(keras, 2, m, schedule, args, None,
                         spans[(m, schedule)]))
    results["bubble_compute"].append(row)
    print(f"| 2 | {m} | {row['formula']:.3f} | {row['gpipe']:.3f} | "
          f"{row['1f1b']:.3f} |")
  results["bound_compute"] = physical_bound(keras, tf, args, devices, spans)

  print(f"\n### Peak activation memory, p = 4, {args.memory_rows} rows per "
        f"micro-batch, 4 x Dense {args.memory_width} per stage (MiB)\n")
  print("| m | batch | GPipe | 1F1B | 1F1B / GPipe |")
  print("|---:|---:|---:|---:|---:|")
  for m in (4, 8, 16):
    row = {"m": m}
    for schedule in SCHEDULES:
      row[schedule] = measure_memory(keras, tf, m, schedule, args)
    results["memory"].append(row)
    print(f"| {m} | {m * args.memory_rows} | {row['gpipe'] / 2**20:.1f} | "
          f"{row['1f1b'] / 2**20:.1f} | {row['1f1b'] / row['gpipe']:.2f} |")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
