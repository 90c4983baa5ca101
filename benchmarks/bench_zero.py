"""Step time and bytes per device of `tfpar.ZeRO` stages 1, 2 and 3 vs
plain data parallelism.

Trains the same Keras MLP (512 inputs -> Dense 1536 relu -> Dense 1536 relu
-> Dense 10 by default: 3,164,170 parameters; Adam; synthetic data from a
fixed seed) in one process with 4 virtual CPUs, under
`tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))`, four times: without
ZeRO ("plain") and with `tfpar.ZeRO(stage=k)` for k = 1, 2, 3 as a `fit`
callback. Every configuration gets its own freshly built and compiled model
and optimizer (same seed, so the same initial weights), since ZeRO shards
the optimizer before `fit` first builds it. All use the same global batch.

Each model is warmed up once with an untimed `model.fit` (tracing, and for
ZeRO the sharding), then the four are measured in alternating runs of
`model.fit` (the order flips from run to run). A run's step time is the
wall time from the start of batch `--skip-steps` to the end of the epoch,
divided by the steps in between. Prints a markdown table with the median
step time of each configuration and, for each stage, the ratio stage /
plain: of the medians, and the median over runs of the per-run ratios.

After the warm-up fit, `tfpar.memory_report` gives the bytes of parameters
and optimizer variables on every device; the table shows the largest over
the 4 devices (they are equal here) beside
`tfpar.zero.estimate_bytes(Ψ, 4, stage)`, the ZeRO paper's formulas for
Ψ trainable parameters and Adam (2 slots per weight). The measured
optimizer bytes include Adam's iteration counter and learning rate
(12 bytes), and ZeRO pads each weight to a multiple of 4 elements; the
differences in bytes are printed below the table. As a check that the four
configurations train alike, the loss of each warm-up fit is printed too.
Last, each configuration's physical bound (`bounds.py`; bytes from the
ZeRO paper's communication volumes) and the ratio median step / bound.

Run from the repository root:

    python benchmarks/bench_zero.py
    python benchmarks/bench_zero.py --runs 5 --steps 30 \
        --output /tmp/zero.json
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
ADAM_SLOTS = 2
PLAIN = "plain"
STAGES = {PLAIN: None, "stage 1": 1, "stage 2": 2, "stage 3": 3}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=9, steps=50)
  common.add_global_batch_flag(parser, 256)
  parser.add_argument("--features", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=1536)
  parser.add_argument("--classes", type=int, default=10)
  return common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)


def callbacks(stage):
  return [tfpar.ZeRO(stage=stage)] if stage else []


def fit(model, x, y, args, stage, extra=()):
  return model.fit(x, y, batch_size=args.global_batch, epochs=1,
                   shuffle=False, steps_per_epoch=args.steps,
                   callbacks=callbacks(stage) + list(extra), verbose=0)


def timed_fit(model, x, y, args, stage):
  timer = common.StepTimer(args.skip_steps)
  fit(model, x, y, args, stage, [timer.callback])
  return timer.step_time(args.steps)


def per_device(report):
  """{"parameters": max bytes, "optimizer": max bytes, "equal": bool}
  over the devices of a `tfpar.memory_report`."""
  devices = report.devices
  parameters = [report.parameters.get(d, 0) for d in devices]
  optimizer = [report.optimizer.get(d, 0) for d in devices]
  return {"devices": len(devices),
          "parameters": max(parameters), "optimizer": max(optimizer),
          "equal": len(set(parameters)) == 1 and len(set(optimizer)) == 1,
          "by_device": {d: {"parameters": report.parameters.get(d, 0),
                            "optimizer": report.optimizer.get(d, 0)}
                        for d in devices}}


def physical_bound(args, devices, x, y, num_params, times):
  """Prints and returns the physical bound of each configuration's step
  (see bounds.py): the MLP's matmul FLOPs at the global batch, and the
  ZeRO paper's communication per device of Ψ float32 gradients over
  g devices, in units of (g-1)/g x 4 Ψ bytes: 2 for plain data
  parallelism (ring all-reduce) and stages 1 and 2 (reduce-scatter of the
  gradients, all-gather of the weights), 3 for stage 3 (the weights are
  all-gathered in the forward and again in the backward pass)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  batch = args.global_batch
  flops, _, _ = bounds.model_flops(
      lambda s: common.build_mlp(s, args), tf.constant(x[:batch]),
      tf.constant(y[:batch]))
  unit = NUM_DEVICES * (NUM_DEVICES - 1) * 4 * num_params / NUM_DEVICES
  machine = bounds.Machine((batch // NUM_DEVICES, args.hidden, args.hidden),
                           devices)
  return bounds.table(machine, {
      name: (flops, (3 if STAGES[name] == 3 else 2) * unit, t)
      for name, t in times.items()})


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(NUM_DEVICES)

  x, y = common.synthetic_classification(args,
                                         args.steps * args.global_batch)
  models, memory, warmup_loss = {}, {}, {}
  for name, stage in STAGES.items():
    strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": NUM_DEVICES}))
    models[name] = common.build_mlp(strategy, args)
    # Compile + trace (and shard, for ZeRO), untimed.
    history = fit(models[name], x, y, args, stage)
    warmup_loss[name] = history.history["loss"][-1]
    memory[name] = per_device(tfpar.memory_report(models[name]))
  num_params = sum(int(w.shape.num_elements())
                   for w in models[PLAIN].trainable_variables)
  estimates = {name: tfpar.zero.estimate_bytes(num_params, NUM_DEVICES,
                                               stage, ADAM_SLOTS)
               for name, stage in STAGES.items()}

  times = common.alternating_times(
      models, args.runs,
      lambda name: timed_fit(models[name], x, y, args, STAGES[name]))

  medians = {name: statistics.median(t) for name, t in times.items()}
  ratios = {name: common.ratios(times[name], times[PLAIN])
            for name in models if name != PLAIN}
  print(f"\n{NUM_DEVICES} virtual CPUs, tfpar.DataParallelStrategy(data "
        f"{NUM_DEVICES}), MLP with {num_params:,} parameters ({args.features}"
        f" -> {args.hidden} -> {args.hidden} -> {args.classes}), Adam, "
        f"global batch {args.global_batch}, {args.steps - args.skip_steps} "
        f"timed steps per run, {args.runs} runs each\n")
  print("| configuration | median step time (ms) | min (ms) | max (ms) | "
        "ratio of medians / plain | median per-run ratio / plain | runs |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for name, t in times.items():
    if name == PLAIN:
      of_medians = per_run = "1.000"
    else:
      of_medians, per_run = (f"{r:.3f}" for r in ratios[name])
    print(f"| {name} | {medians[name] * 1e3:.2f} | {min(t) * 1e3:.2f} | "
          f"{max(t) * 1e3:.2f} | {of_medians} | {per_run} | {len(t)} |")
  print()
  for name in ratios:
    per_run = [a / b for a, b in zip(times[name], times[PLAIN])]
    print(f"{name} / plain: per-run ratios from {min(per_run):.3f} to "
          f"{max(per_run):.3f}")

  equal = all(m["equal"] for m in memory.values())
  print(f"\nbytes per device after the first fit (tfpar.memory_report, "
        f"largest over the {NUM_DEVICES} devices; all devices "
        f"{'equal' if equal else 'NOT equal'}), beside "
        f"tfpar.zero.estimate_bytes(Ψ = {num_params:,}, {NUM_DEVICES}, "
        f"stage)\n")
  print("| configuration | parameters measured | parameters estimate | "
        "measured / estimate | optimizer measured | optimizer estimate | "
        "measured / estimate | total measured | total / plain |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  plain_total = memory[PLAIN]["parameters"] + memory[PLAIN]["optimizer"]
  for name, m in memory.items():
    e = estimates[name]
    total = m["parameters"] + m["optimizer"]
    print(f"| {name} | {m['parameters']:,} | {e.parameters:,} | "
          f"{m['parameters'] / e.parameters:.4f} | {m['optimizer']:,} | "
          f"{e.optimizer:,} | {m['optimizer'] / e.optimizer:.4f} | "
          f"{total:,} | {total / plain_total:.3f} |")
  print("\nmeasured - estimate, bytes per device: " + "; ".join(
      f"{name} parameters {m['parameters'] - estimates[name].parameters:,}, "
      f"optimizer {m['optimizer'] - estimates[name].optimizer:,}"
      for name, m in memory.items()))
  print("\nloss after the untimed warm-up fit: " + ", ".join(
      f"{name} {loss:.6f}" for name, loss in warmup_loss.items()))

  bound = physical_bound(args, devices, x, y, num_params, times)

  common.write_json(args.output, {
      "physical_bound": bound,
      "benchmark": "zero", "devices": NUM_DEVICES,
      "num_params": num_params, "global_batch": args.global_batch,
      "features": args.features, "hidden": args.hidden,
      "classes": args.classes,
      "timed_steps_per_run": args.steps - args.skip_steps,
      "runs": args.runs, "step_times_s": times,
      "median_step_time_s": medians,
      "ratio_over_plain": {name: r[0] for name, r in ratios.items()},
      "median_per_run_ratio_over_plain": {
          name: r[1] for name, r in ratios.items()},
      "bytes_per_device_measured": memory,
      "bytes_per_device_estimate": {
          name: {"parameters": e.parameters, "optimizer": e.optimizer,
                 "gradient_buffers": e.gradient_buffers}
          for name, e in estimates.items()},
      "warmup_loss": warmup_loss,
  })


if __name__ == "__main__":
  main()
