"""`mixed_bfloat16` against `float32` under ZeRO-3 and tensor parallelism.

Trains benchmark 3's small GPT (stock Keras layers, Adam) on 4 virtual
CPUs in four configurations: `tfpar.ZeRO(stage=3)` over data 4 and
`tfpar.TensorParallelStrategy` over data 2 x tensor 2 (the built-in plan
with a column-parallel head, as in benchmark 3), each under Keras's
`float32` and `mixed_bfloat16` policies. Each model is built under its
policy, compiled and warmed up (its first step inside a
`tfpar.CommunicationLog`), then the four are measured in alternating runs
of `model.fit`, the order rotating from run to run. Prints per
configuration the median step time, the step-time ratio bfloat16 /
float32 (of the medians, and the median of the per-run ratios) and the
bytes replica 0 sends in one step from the communication log (ZeRO-3: its
all-gathers and reduce-scatters; tensor parallelism: its tensor-group
traffic), with the bfloat16 / float32 ratio.

Last, each configuration's physical bound (`bounds.py`, at the matmul
rate of its compute dtype) and the ratio median step time / bound.

CPUs compute bfloat16 in software: the step times here say what the
policy costs on CPUs, not on accelerators; the bytes carry over.

Run from the repository root:

    python benchmarks/bench_precision.py
    python benchmarks/bench_precision.py --runs 5 --steps 30 \
        --output /tmp/precision.json
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_tensor_vs_data_parallel as gpt_benchmark  # pylint: disable=g-import-not-at-top
import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
POLICIES = ("float32", "mixed_bfloat16")
LAYOUTS = ("ZeRO-3, data 4", "data 2 x tensor 2")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=5, steps=30)
  common.add_global_batch_flag(parser, 32, unit="sequences")
  common.add_gpt_flags(parser)
  return common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)


def strategy_and_callbacks(layout):
  if layout.startswith("ZeRO"):
    return (tfpar.DataParallelStrategy(tfpar.Mesh({"data": NUM_DEVICES})),
            lambda: [tfpar.ZeRO(stage=3)])
  plan = tfpar.ShardingPlan([(r"^lm_head/", tfpar.ColumnParallel())])
  # Megatron's communication in the compute dtype: half the bytes of
  # float32 (the default adds partial sums in float32).
  return (tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}), plan=plan,
      communication_dtype="compute"), lambda: [])


def sent_bytes(log):
  """Bytes replica 0 sends in one step, from its log records."""
  return sum(record.bytes for record in log.step_records(0))


def physical_bound(args, devices, dataset, models, nbytes, times):
  """Prints and returns the physical bound of each configuration's step
  (see bounds.py): the GPT's matmul FLOPs at the global batch, at the
  matmul rate of the policy's compute dtype; bytes: ZeRO-3, replica 0's
  logged sends times the 4 replicas; tensor parallelism, replica 0's
  logged sends times the 2 data replicas plus the float32 gradient
  all-reduce over the data axis."""
  x, y = next(iter(dataset))
  flops, _, _ = bounds.model_flops(
      lambda s: gpt_benchmark.build_model(s, args), x, y)
  machine = bounds.Machine(
      (args.global_batch // NUM_DEVICES * args.sequence, args.width,
       4 * args.width), devices, dtypes=("float32", "bfloat16"))
  rows = {}
  for key, t in times.items():
    layout, policy = key
    if layout.startswith("ZeRO"):
      moved = nbytes[key] * NUM_DEVICES
    else:
      moved = nbytes[key] * 2 + gpt_benchmark.gradient_bytes(models[key], 2)
    rows[f"{layout}, {policy}"] = (flops, moved, t)
  return bounds.table(machine, rows, dtype_of=lambda name: (
      "bfloat16" if name.endswith("bfloat16") else "float32"))


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  import keras  # pylint: disable=g-import-not-at-top
  dataset = gpt_benchmark.token_dataset(args)
  models, callbacks, nbytes = {}, {}, {}
  for layout in LAYOUTS:
    for policy in POLICIES:
      keras.mixed_precision.set_global_policy(policy)
      strategy, make_callbacks = strategy_and_callbacks(layout)
      key = (layout, policy)
      models[key] = gpt_benchmark.build_model(strategy, args)
      callbacks[key] = make_callbacks
      with tfpar.CommunicationLog() as log:
        models[key].fit(dataset, epochs=1, steps_per_epoch=args.skip_steps,
                        callbacks=make_callbacks(), verbose=0)
      nbytes[key] = sent_bytes(log)
  keras.mixed_precision.set_global_policy("float32")
  times = {key: [] for key in models}
  keys = list(models)
  for run in range(args.runs):
    order = keys[run % len(keys):] + keys[:run % len(keys)]
    for key in order:
      timer = common.StepTimer(args.skip_steps)
      models[key].fit(dataset, epochs=1, steps_per_epoch=args.steps,
                      callbacks=callbacks[key]() + [timer.callback],
                      verbose=0)
      times[key].append(timer.step_time(args.steps))
  print("| layout | policy | ms / step | bytes sent by replica 0 / step |")
  print("|---|---|---|---|")
  result = {}
  for key in keys:
    print(f"| {key[0]} | {key[1]} | {1e3 * statistics.median(times[key]):.1f}"
          f" | {nbytes[key]:,} |")
  print()
  for layout in LAYOUTS:
    low, full = (layout, POLICIES[1]), (layout, POLICIES[0])
    of_medians, per_run = common.ratios(times[low], times[full])
    byte_ratio = nbytes[low] / nbytes[full]
    print(f"{layout}: step time bfloat16 / float32 {of_medians:.3f} (ratio "
          f"of medians), {per_run:.3f} (median per-run ratio); bytes "
          f"{byte_ratio:.3f}")
    result[layout] = {
        "ms_float32": 1e3 * statistics.median(times[full]),
        "ms_bfloat16": 1e3 * statistics.median(times[low]),
        "time_ratio": {"of_medians": of_medians, "per_run": per_run},
        "bytes_float32": nbytes[full], "bytes_bfloat16": nbytes[low],
        "bytes_ratio": byte_ratio}
  result["physical_bound"] = physical_bound(args, devices, dataset, models,
                                            nbytes, times)
  common.write_json(args.output, result)


if __name__ == "__main__":
  main()
