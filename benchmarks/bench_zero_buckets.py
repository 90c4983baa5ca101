"""ZeRO-3's fused collectives: collectives per step, bytes per device,
step time against plain data parallelism, and when the reduce-scatters run.

Trains bench_zero.py's MLP (512 -> Dense 1536 relu -> Dense 1536 relu ->
Dense 10: 3,164,170 parameters, 12.7 MB; Adam) in one process on 4
virtual CPUs under `tfpar.DataParallelStrategy(data 4)`:

* "plain": no ZeRO;
* "stage 3, per weight": `tfpar.ZeRO(stage=3, bucket_bytes=1)`, one
  bucket per weight: the collectives stage 3 launched before buckets;
* "stage 3, per layer": buckets of the largest layer's bytes (each layer
  fits, the model does not);
* "stage 3, one bucket": the default 32 MiB (the whole model fits).

1. Collectives per step, counted at run time by wrapping TensorFlow's
   own `all_gather_v2`, `all_to_all_v2` and `all_reduce_v2`
   (tests/collective_count.py), in a separate fit of each configuration;
   and the bytes each device sends per step from the counted inputs,
   beside the ZeRO paper's count.
2. Step times in alternating runs (`common.alternating_times`), medians
   and ratios over plain, and the physical bound (`bounds.py`).
3. The order in which device 0 runs the collectives of one step ("per
   layer"): TensorFlow runs one device's collectives in the order they
   were created.

Run from the repository root:

    python benchmarks/bench_zero_buckets.py --output /tmp/zero_buckets.json
"""

import argparse
import contextlib
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "tests"))

import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

DEVICES = 4
PLAIN = "plain"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=7, steps=25)
  common.add_global_batch_flag(parser, 256)
  parser.add_argument("--features", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=1536)
  parser.add_argument("--classes", type=int, default=10)
  return common.parse_checked(parser, argv, batch_multiple=DEVICES)


def configurations(args):
  layer = 4 * max(args.features * args.hidden + args.hidden,
                  args.hidden * args.hidden + args.hidden)
  return {PLAIN: None, "stage 3, per weight": 1,
          "stage 3, per layer": layer,
          "stage 3, one bucket": tfpar.ZeRO().bucket_bytes}


def fit(model, x, y, args, bucket_bytes, steps, extra=()):
  zero = ([tfpar.ZeRO(stage=3, bucket_bytes=bucket_bytes)]
          if bucket_bytes else [])
  return model.fit(x, y, batch_size=args.global_batch, epochs=1,
                   shuffle=False, steps_per_epoch=steps,
                   callbacks=zero + list(extra), verbose=0)


def counted(args, x, y, bucket_bytes, steps=3):
  """Collectives per step (each over the 4 devices) and bytes sent per
  device and step of a fresh model's fit of `steps` steps."""
  import collective_count  # pylint: disable=g-import-not-at-top
  from tensorflow.python.ops import collective_ops  # pylint: disable=g-import-not-at-top
  model = common.build_mlp(tfpar.DataParallelStrategy(
      tfpar.Mesh({"data": DEVICES})), args)
  original, reduces = collective_ops.all_reduce_v2, []

  def all_reduce_v2(t, *rest, **kwargs):  # Counted at trace time.
    reduces.append(t.shape.num_elements() * t.dtype.size)
    return original(t, *rest, **kwargs)
  collective_ops.all_reduce_v2 = all_reduce_v2
  try:
    with collective_count.gathers_and_all_to_alls() as totals:
      fit(model, x, y, args, bucket_bytes, steps)
  finally:
    collective_ops.all_reduce_v2 = original
  per = steps * DEVICES
  gathers, to_all = totals["all-gather"] / per, totals["all-to-all"] / per
  # An all-gather sends its input to the 3 others; an all-to-all sends
  # 3/4 of its input; a ring all-reduce 2 x 3/4 of it (traced once).
  sent = (totals["all-gather bytes"] / per * (DEVICES - 1) +
          totals["all-to-all bytes"] / per * (DEVICES - 1) / DEVICES +
          sum(reduces) / DEVICES * 2 * (DEVICES - 1) / DEVICES)
  return {"all-gather": gathers, "all-to-all": to_all,
          "all-reduce": len(reduces) / DEVICES, "bytes_sent": sent}


@contextlib.contextmanager
def collective_order():
  """Records the all-gathers and all-to-alls of functions traced in the
  block, in the order they are created on each device: the order
  TensorFlow runs one device's collectives (its launchers' ordering
  token). Yields {device index: [kind]}.

  (A `tf.timestamp` after each collective, to time them, deadlocked the
  step: TensorFlow orders stateful ops of one traced function, so the
  replicas' stamps chained their collectives together.)"""
  from tensorflow.python.ops import collective_ops  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  order = {}
  originals = {"all-gather": collective_ops.all_gather_v2,
               "all-to-all": collective_ops.all_to_all_v2}

  def recorded(kind):
    def launch(t, *rest, **kwargs):
      result = originals[kind](t, *rest, **kwargs)
      index = tf.DeviceSpec.from_string(result.device).device_index
      order.setdefault(index, []).append(kind)
      return result
    return launch

  collective_ops.all_gather_v2 = recorded("all-gather")
  collective_ops.all_to_all_v2 = recorded("all-to-all")
  try:
    yield order
  finally:
    collective_ops.all_gather_v2 = originals["all-gather"]
    collective_ops.all_to_all_v2 = originals["all-to-all"]


def issue_order(args, x, y, bucket_bytes):
  """The kinds of device 0's collectives of one step, in the order
  TensorFlow runs them."""
  model = common.build_mlp(tfpar.DataParallelStrategy(
      tfpar.Mesh({"data": DEVICES})), args)
  with collective_order() as order:
    fit(model, x, y, args, bucket_bytes, steps=2)
  return order[0]


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(DEVICES)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x, y = common.synthetic_classification(args,
                                         args.steps * args.global_batch)
  configs = configurations(args)

  counts = {name: counted(args, x, y, size) for name, size in configs.items()}
  events = issue_order(args, x, y, configs["stage 3, per layer"])

  models = {}
  for name, size in configs.items():
    models[name] = common.build_mlp(tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": DEVICES})), args)
    fit(models[name], x, y, args, size, args.steps)  # Traces, shards.
  num_params = sum(int(w.shape.num_elements())
                   for w in models[PLAIN].trainable_variables)

  def timed(name):
    timer = common.StepTimer(args.skip_steps)
    fit(models[name], x, y, args, configs[name], args.steps,
        [timer.callback])
    return timer.step_time(args.steps)
  times = common.alternating_times(models, args.runs, timed)

  paper = {PLAIN: 2, "stage 3": 3}  # x (g-1)/g x 4 Ψ per device
  unit = (DEVICES - 1) / DEVICES * 4 * num_params
  print(f"\n{DEVICES} virtual CPUs, MLP with {num_params:,} parameters "
        f"({4 * num_params:,} bytes), Adam, global batch "
        f"{args.global_batch}; {args.runs} alternating runs of "
        f"{args.steps - args.skip_steps} timed steps\n")
  print("| configuration | bucket_bytes | all-gathers / step | all-to-alls "
        "/ step | all-reduces / step | bytes sent / device / step | paper "
        "| median step (ms) | ratio of medians / plain | median per-run "
        "ratio / plain |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  results = {}
  for name, size in configs.items():
    c = counts[name]
    expected = paper[PLAIN if name == PLAIN else "stage 3"] * unit
    of_medians, per_run = common.ratios(times[name], times[PLAIN])
    median = statistics.median(times[name])
    results[name] = dict(c, bucket_bytes=size, paper_bytes=expected,
                         median_step_s=median, ratio_of_medians=of_medians,
                         median_per_run_ratio=per_run)
    print(f"| {name} | {size or '-'} | {c['all-gather']:g} | "
          f"{c['all-to-all']:g} | {c['all-reduce']:g} | "
          f"{c['bytes_sent']:,.0f} | {expected:,.0f} | {median * 1e3:.2f} | "
          f"{of_medians:.3f} | {per_run:.3f} |")
  for name in configs:
    if name != PLAIN:
      per = [a / b for a, b in zip(times[name], times[PLAIN])]
      print(f"{name} / plain: per-run ratios {min(per):.3f} to "
            f"{max(per):.3f}")

  print("\ncollectives of one step on device 0, 'per layer' buckets, in "
        "the order TensorFlow runs them: " + ", ".join(events))

  batch = args.global_batch
  flops, _, _ = bounds.model_flops(
      lambda s: common.build_mlp(s, args), tf.constant(x[:batch]),
      tf.constant(y[:batch]))
  machine = bounds.Machine((batch // DEVICES, args.hidden, args.hidden),
                           devices)
  bound = bounds.table(machine, {
      name: (flops, DEVICES * results[name]["paper_bytes"], times[name])
      for name in configs})
  common.write_json(args.output, {
      "benchmark": "zero_buckets", "devices": DEVICES,
      "num_params": num_params, "global_batch": batch, "runs": args.runs,
      "timed_steps_per_run": args.steps - args.skip_steps,
      "results": results, "step_times_s": times,
      "issue_order_device0": events, "physical_bound": bound})


if __name__ == "__main__":
  main()
