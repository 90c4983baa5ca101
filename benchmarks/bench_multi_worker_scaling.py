"""Training throughput of 2 loopback workers vs 1 with DataParallelStrategy.

Weak scaling: every worker trains on a fixed per-worker batch, so the global
batch grows with the number of workers. Each worker is single-threaded
(intra-op and inter-op parallelism 1, one CPU device) and builds its
strategy with `tfpar.DataParallelStrategy(tfpar.Mesh.from_cluster_resolver(
data=-1))` from the `TF_CONFIG` that `tfpar launch` gives it.

The driver (this script without `--worker`) starts itself as workers with

    python -m tfpar launch --workers N --timeout T \
        benchmarks/bench_multi_worker_scaling.py --worker ...

for N = 1 and N = 2, alternating, `--runs` times each. In every run each
worker compiles and warms up with one untimed `model.fit`, then runs a
second `model.fit`; the chief measures samples/second from the start of batch
`--skip-steps` to the end of that epoch and prints one `BENCH_RESULT {json}`
line, which the driver parses. The driver prints a markdown table with the
median throughput of each worker count and the ratio 2-worker / 1-worker,
both of the medians and as the median of the per-round ratios (the 1- and
2-worker runs of one round ran back to back). Then it measures the
machine model for single-threaded workers (`bounds.py`) and prints the
physical bound of a worker's step and the ratio median step / bound.

Run from the repository root:

    python benchmarks/bench_multi_worker_scaling.py
    python benchmarks/bench_multi_worker_scaling.py --runs 3 --steps 300 \
        --output /tmp/multi_worker_scaling.json
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

import common

RESULT_PREFIX = "BENCH_RESULT "
WORKER_COUNTS = (1, 2)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", action="store_true",
                      help="internal: run as one tfpar launch worker")
  common.add_common_flags(parser, runs=3, steps=300)
  parser.add_argument("--per-worker-batch", type=int, default=128)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--timeout", type=float, default=180,
                      help="seconds before tfpar launch stops the workers")
  return common.parse_checked(parser, argv)


def worker_main(args):
  """One `tfpar launch` worker: trains, and the chief prints the result."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Before any op runs: one thread per worker.
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  import tfpar  # pylint: disable=g-import-not-at-top

  mesh = tfpar.Mesh.from_cluster_resolver(data=-1)
  strategy = tfpar.DataParallelStrategy(mesh)
  global_batch = args.per_worker_batch * mesh.num_workers

  x, y = common.synthetic_classification(args, args.steps * global_batch)
  model = common.build_mlp(strategy, args)

  def fit():
    timer = common.StepTimer(args.skip_steps)
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False,
              steps_per_epoch=args.steps, callbacks=[timer.callback],
              verbose=0)
    return timer.seconds

  fit()  # compile, trace and connect, untimed
  seconds = fit()
  timed_steps = args.steps - args.skip_steps
  if mesh.cluster is None or mesh.cluster.task_index == 0:
    print(RESULT_PREFIX + json.dumps({
        "workers": mesh.num_workers,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch": global_batch,
        "timed_steps": timed_steps,
        "seconds": seconds,
        "samples_per_second": timed_steps * global_batch / seconds,
    }), flush=True)


def launch_once(num_workers, args):
  """Runs the workers once; returns the chief's result dict."""
  worker_args = ["--worker"]
  for name in ("steps", "skip_steps", "per_worker_batch", "features",
               "hidden", "classes", "seed"):
    worker_args += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
  script = os.path.abspath(__file__)
  env = dict(os.environ)
  env.pop("TF_CONFIG", None)
  command = [sys.executable, "-m", "tfpar", "launch",
             "--workers", str(num_workers), "--timeout", str(args.timeout),
             script] + worker_args
  proc = subprocess.run(command, capture_output=True, text=True, env=env,
                        timeout=args.timeout + 30, check=False)
  for line in proc.stdout.splitlines():
    _, found, payload = line.partition(RESULT_PREFIX)
    if found and proc.returncode == 0:
      return json.loads(payload)
  sys.exit(f"the {num_workers}-worker run failed with exit code "
           f"{proc.returncode}; its output ends with:\n"
           + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))


def physical_bound(args, results):
  """Prints and returns the physical bound of an n-worker step (see
  bounds.py), measured here after the launches: each single-threaded
  worker computes its own batch on its own core (min(cores, n) cores; the
  single-thread matmul rate is measured, the cores are assumed to add up),
  and sends 2 (n-1)/n of its float32 gradients over TCP loopback, at the
  rate of one measured loopback stream (the n streams are assumed to run
  in parallel)."""
  import bounds  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  batch = args.per_worker_batch
  x, y = common.synthetic_classification(args, batch)
  flops, _, _ = bounds.model_flops(lambda s: common.build_mlp(s, args),
                                   tf.constant(x), tf.constant(y))
  num_params = 4 * ((args.features + 1) * args.hidden
                    + (args.hidden + 1) * args.hidden
                    + (args.hidden + 1) * args.classes)
  rate, _ = bounds.matmul_rate((batch, args.hidden, args.hidden), ["/CPU:0"])
  loopback = bounds.loopback_bandwidth()
  cores = os.cpu_count()
  print(f"\nmachine model: one thread, float32 matmul {batch}x{args.hidden}x"
        f"{args.hidden}: {rate / 1e9:.1f} GFLOP/s; {cores} cores; TCP "
        f"loopback, one stream: {loopback / 1e9:.2f} GB/s\n")
  print("| workers | FLOPs / worker step | bytes sent / worker step | compute "
        "bound (ms) | copy bound (ms) | bound (ms) | bound samples/s | "
        "median step (ms) | step / bound |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  out = {"flops_per_second_one_thread": rate, "loopback_bytes_per_second":
         loopback, "cores": cores}
  for n in WORKER_COUNTS:
    steps = [r["seconds"] / r["timed_steps"] for r in results[n]]
    # Each worker computes alone only if there is a core per worker.
    compute = flops * math.ceil(n / min(cores, n)) / rate
    nbytes = bounds.ring_all_reduce_bytes(num_params, n)
    bound = compute + nbytes / loopback
    median = statistics.median(steps)
    out[n] = {"flops": flops, "bytes": nbytes, "compute_s": compute,
              "copy_s": nbytes / loopback, "bound_s": bound,
              "median_step_s": median, "ratio": median / bound}
    print(f"| {n} | {flops / 1e6:,.1f} M | {nbytes:,} | {compute * 1e3:.3f} | "
          f"{nbytes / loopback * 1e3:.3f} | {bound * 1e3:.3f} | "
          f"{n * batch / bound:,.0f} | {median * 1e3:.2f} | "
          f"{median / bound:.1f} |")
  return out


def driver_main(args):
  results = {n: [] for n in WORKER_COUNTS}
  for run in range(args.runs):
    for n in common.alternating(WORKER_COUNTS, run):
      results[n].append(launch_once(n, args))
      print(f"run {run + 1}/{args.runs} workers={n}: "
            f"{results[n][-1]['samples_per_second']:.0f} samples/s",
            file=sys.stderr, flush=True)

  throughput = {n: [r["samples_per_second"] for r in results[n]]
                for n in WORKER_COUNTS}
  medians = {n: statistics.median(t) for n, t in throughput.items()}
  ratio, paired = common.ratios(throughput[2], throughput[1])
  print(f"\nweak scaling on loopback, single-threaded workers, "
        f"per-worker batch {args.per_worker_batch}, "
        f"{args.steps - args.skip_steps} timed steps per run, "
        f"{args.runs} runs each\n")
  print("| workers | global batch | median samples/s | min | max | runs |")
  print("|---:|---:|---:|---:|---:|---:|")
  for n in WORKER_COUNTS:
    t = throughput[n]
    print(f"| {n} | {results[n][0]['global_batch']} | {medians[n]:.0f} | "
          f"{min(t):.0f} | {max(t):.0f} | {len(t)} |")
  print(f"\nratio 2-worker / 1-worker, of the median samples/s: {ratio:.3f}; "
        f"median of the per-round ratios: {paired:.3f}")

  bound = physical_bound(args, results)

  common.write_json(args.output, {
      "physical_bound": bound,
      "benchmark": "multi_worker_scaling",
      "per_worker_batch": args.per_worker_batch,
      "timed_steps_per_run": args.steps - args.skip_steps,
      "runs": args.runs,
      "results": {str(n): r for n, r in results.items()},
      "median_samples_per_second": {str(n): m for n, m in medians.items()},
      "ratio_2_over_1": ratio,
      "median_per_round_ratio_2_over_1": paired})


if __name__ == "__main__":
  _args = parse_args()
  if _args.worker:
    worker_main(_args)
  else:
    driver_main(_args)
