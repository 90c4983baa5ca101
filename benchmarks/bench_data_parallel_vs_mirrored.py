"""Step time of `tfpar.DataParallelStrategy` vs stock `MirroredStrategy`.

Trains the same Keras MLP (Dense layers, Adam, synthetic data from a fixed
seed) in one process with 4 virtual CPUs, under
`tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))` and under
`tf.distribute.MirroredStrategy` on the same 4 CPU devices, with the same
global batch. Each strategy's model is compiled and warmed up once, then the
two are measured in alternating runs of `model.fit`. A run's step time is the
wall time from the start of batch `--skip-steps` to the end of the epoch
(when Keras has fetched the results), divided by the steps in between, so
tracing and input-pipeline start-up are left out.

Prints a markdown table with the median step time of each strategy and the
ratio tfpar / Mirrored measured in the same process: the ratio of the
medians, and the median over runs of the ratio within each run (the two
strategies measured back to back), which cancels most of the drift that
other load on the machine causes. Then prints each strategy's physical
bound (`bounds.py`: the MLP's matmul FLOPs at the machine's measured
matmul rate plus the ring all-reduce's bytes at its copy bandwidth) and
the ratio median step time / bound.

Run from the repository root:

    python benchmarks/bench_data_parallel_vs_mirrored.py
    python benchmarks/bench_data_parallel_vs_mirrored.py --runs 7 \
        --steps 100 --output /tmp/dp_vs_mirrored.json
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=7, steps=100)
  common.add_global_batch_flag(parser, 256)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--classes", type=int, default=10)
  return common.parse_checked(parser, argv)


def timed_fit(model, x, y, args):
  timer = common.StepTimer(args.skip_steps)
  model.fit(x, y, batch_size=args.global_batch, epochs=1, shuffle=False,
            steps_per_epoch=args.steps, callbacks=[timer.callback], verbose=0)
  return timer.step_time(args.steps)


def physical_bound(args, devices, x, y, num_params, times):
  """Prints and returns the physical bound of both strategies' step (see
  bounds.py): the MLP's matmul FLOPs at the global batch, and the ring
  all-reduce of the float32 gradients over the 4 devices."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  batch = args.global_batch
  flops, _, _ = bounds.model_flops(
      lambda s: common.build_mlp(s, args), tf.constant(x[:batch]),
      tf.constant(y[:batch]))
  nbytes = NUM_DEVICES * bounds.ring_all_reduce_bytes(4 * num_params,
                                                      NUM_DEVICES)
  machine = bounds.Machine((batch // NUM_DEVICES, args.hidden, args.hidden),
                           devices)
  return bounds.table(machine, {name: (flops, nbytes, t)
                                for name, t in times.items()})


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  strategies = common.data_parallel_and_mirrored(devices)
  x, y = common.synthetic_classification(args,
                                         args.steps * args.global_batch)
  models = {name: common.build_mlp(s, args)
            for name, s in strategies.items()}
  num_params = next(iter(models.values())).count_params()
  for model in models.values():  # compile + trace, untimed
    timed_fit(model, x, y, args)

  times = common.alternating_times(
      models, args.runs, lambda name: timed_fit(models[name], x, y, args))

  medians = {name: statistics.median(t) for name, t in times.items()}
  tfpar_name, mirrored_name = models
  ratio, paired = common.ratios(times[tfpar_name], times[mirrored_name])
  print(f"\n{NUM_DEVICES} virtual CPUs, MLP with {num_params:,} parameters, "
        f"global batch {args.global_batch}, {args.steps - args.skip_steps} "
        f"timed steps per run, {args.runs} runs each\n")
  print("| strategy | median step time (ms) | min (ms) | max (ms) | runs |")
  print("|---|---:|---:|---:|---:|")
  for name, t in times.items():
    print(f"| `{name}` | {medians[name] * 1e3:.2f} | {min(t) * 1e3:.2f} | "
          f"{max(t) * 1e3:.2f} | {len(t)} |")
  print(f"\nratio tfpar / Mirrored, of the median step times: {ratio:.3f}; "
        f"median of the per-run ratios: {paired:.3f}")
  bound = physical_bound(args, devices, x, y, num_params, times)

  if args.output:
    result = {
        "benchmark": "data_parallel_vs_mirrored", "devices": NUM_DEVICES,
        "num_params": num_params, "global_batch": args.global_batch,
        "timed_steps_per_run": args.steps - args.skip_steps,
        "runs": args.runs,
        "step_times_s": times, "median_step_time_s": medians,
        "ratio_tfpar_over_mirrored": ratio,
        "median_per_run_ratio_tfpar_over_mirrored": paired,
        "physical_bound": bound,
    }
    common.write_json(args.output, result)


if __name__ == "__main__":
  main()
