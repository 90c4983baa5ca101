"""Memory a process gains per step: collectives' instance keys.

TensorFlow's collective launchers feed each collective a new instance key
at every call of the traced step, and its runtime keeps a record per key
and device for the life of the process. tfpar's strategies in one process
draw the keys when the step is traced (`tfpar/_compat/traced_keys.py`).

Trains the same Keras MLP (benchmark 1's, smaller by default) in one
process with 4 virtual CPUs under `tfpar.DataParallelStrategy` and stock
`tf.distribute.MirroredStrategy`, each compiled and warmed up once, then in
alternating runs of `model.fit` of `--steps` steps. For each run it reads
the process's resident memory (`VmRSS` in /proc/self/status) before and
after the `fit`, and the run's step time (`common.StepTimer`). Prints the
median bytes gained per step and step time of each strategy, and the
ratio of the step times (of the medians and the median per-run ratio).

Run from the repository root (Linux):

    python benchmarks/bench_instance_keys.py
    python benchmarks/bench_instance_keys.py --runs 3 --steps 4000 \
        --output /tmp/instance_keys.json
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=3, steps=4000, skip_steps=5)
  common.add_global_batch_flag(parser, 64)
  parser.add_argument("--features", type=int, default=32)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--classes", type=int, default=10)
  return common.parse_checked(parser, argv)


def resident_bytes():
  """The process's resident memory, from /proc/self/status."""
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def measured_fit(model, dataset, args):
  """(bytes gained per step, seconds per timed step) of one `fit`."""
  timer = common.StepTimer(args.skip_steps)
  before = resident_bytes()
  model.fit(dataset, epochs=1, steps_per_epoch=args.steps,
            callbacks=[timer.callback], verbose=0)
  return (resident_bytes() - before) / args.steps, timer.step_time(args.steps)


def main(argv=None):
  args = parse_args(argv)
  strategies = common.data_parallel_and_mirrored(
      tfpar.configure_virtual_cpus(NUM_DEVICES))
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x, y = common.synthetic_classification(args, args.global_batch * 16)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
      args.global_batch, drop_remainder=True).repeat()
  models = {name: common.build_mlp(s, args) for name, s in strategies.items()}
  warm = argparse.Namespace(**{**vars(args), "steps": args.skip_steps + 50})
  for model in models.values():  # compile, trace and settle, unmeasured
    measured_fit(model, dataset, warm)

  growth = {name: [] for name in models}
  times = {name: [] for name in models}
  for run in range(args.runs):
    for name in common.alternating(models, run):
      per_step, seconds = measured_fit(models[name], dataset, args)
      growth[name].append(per_step)
      times[name].append(seconds)
      print(f"run {run + 1}/{args.runs} {name}: {per_step:+.0f} B/step, "
            f"{seconds * 1e3:.2f} ms/step", file=sys.stderr)

  tfpar_name, mirrored_name = models
  ratio, paired = common.ratios(times[tfpar_name], times[mirrored_name])
  print(f"\n{NUM_DEVICES} virtual CPUs, MLP of "
        f"{next(iter(models.values())).count_params():,} parameters, global "
        f"batch {args.global_batch}, {args.steps} steps per run, {args.runs} "
        f"runs each\n")
  print("| strategy | resident bytes per step (median) | per run | "
        "median step time (ms) |")
  print("|---|---:|---|---:|")
  for name in models:
    runs = ", ".join(f"{g:+.0f}" for g in growth[name])
    print(f"| `{name}` | {statistics.median(growth[name]):+.0f} | {runs} | "
          f"{statistics.median(times[name]) * 1e3:.2f} |")
  print(f"\nstep time tfpar / Mirrored, of the medians: {ratio:.3f}; median "
        f"of the per-run ratios: {paired:.3f}")
  common.write_json(args.output, {
      "benchmark": "instance_keys", "devices": NUM_DEVICES,
      "steps_per_run": args.steps, "runs": args.runs,
      "bytes_per_step": growth, "step_times_s": times,
      "ratio_tfpar_over_mirrored": ratio,
      "median_per_run_ratio_tfpar_over_mirrored": paired,
  })


if __name__ == "__main__":
  main()
