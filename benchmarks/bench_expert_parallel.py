"""Expert parallelism (`ExpertParallelStrategy`, expert 2 and 4) vs
replicated experts (`DataParallelStrategy`): step time and bytes per device.

Trains the same keras-hub `MixtralBackbone` language model (random init,
Adam, random tokens from a fixed seed, fixed-size batches) in one process
on 4 virtual CPUs under `tfpar.DataParallelStrategy(tfpar.Mesh({"data":
4}))`, where every device holds every expert, and under
`tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 4}), expert=e)` for
e = 2 and 4, with the same global batch and the same initial weights.

* Bytes per device, counted here from the per-device components of
  `model.weights` and `model.optimizer.variables`.
* Bytes each device sends per step, three ways: a run-time counter of
  every collective it runs (TF's all-reduce, all-gather and all-to-all ops
  wrapped while the first `fit` traces its step; a ring all-reduce sends
  2 (g-1)/g of its input, all-gather (g-1) times it, all-to-all (g-1)/g),
  replica 0's `tfpar.CommunicationLog` (expert strategies: all-to-alls,
  router statistics, expert gradients), and formulas: per MoE layer and
  step 4 all-to-alls (dispatch and return, forward and backward) of
  E C h 4 (e-1)/e bytes (C = T, the tokens per replica, unless
  `--capacity-factor`), beside the textbook T h 4 (e-1)/e.
* Step time: each model is traced again without the counter and warmed
  up; then the three alternate run by run (the order flips every run).
  Ratios to data parallelism: of the medians, and median per-run ratio.
* The physical bound of each layout's step (`bounds.py`; bytes from the
  run-time counter, all devices) and the ratio median step time / bound.

Run from the repository root:

    python benchmarks/bench_expert_parallel.py
    python benchmarks/bench_expert_parallel.py --runs 21 --steps 40 \
        --output /tmp/expert_parallel.json
"""

import argparse
import collections
import contextlib
import math
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top
from tensorflow.python.ops import collective_ops  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
COUNTED_STEPS = 2
DP_NAME = "data 4, experts replicated"
# Collective: (kind, sent bytes = input * numerator(g) / denominator(g)).
SENT = {"all_reduce_v2": ("all-reduce", lambda g: 2 * (g - 1), lambda g: g),
        "all_gather_v2": ("all-gather", lambda g: g - 1, lambda g: 1),
        "all_to_all_v2": ("all-to-all", lambda g: g - 1, lambda g: g)}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=15, steps=30)
  common.add_global_batch_flag(parser, 16, unit="sequences")
  for flag, default in (("sequence", 32), ("hidden", 64), ("layers", 2),
                        ("intermediate", 256), ("experts", 8), ("top-k", 2),
                        ("heads", 4), ("vocab", 128)):
    parser.add_argument(f"--{flag}", type=int, default=default)
  parser.add_argument("--capacity-factor", type=float, default=None,
                      help="of the expert strategies (default None: C = T)")
  return common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)


def build_model(strategy, args):
  import keras  # pylint: disable=g-import-not-at-top
  import keras_hub  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(args.seed)  # The same weights under each.
  with strategy.scope():
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=args.vocab, num_layers=args.layers,
        num_query_heads=args.heads, num_key_value_heads=args.heads // 2,
        hidden_dim=args.hidden, intermediate_dim=args.intermediate,
        num_experts=args.experts, top_k=args.top_k)
    model = keras.Model(backbone.input, backbone.token_embedding(
        backbone.output, reverse=True))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses
                  .SparseCategoricalCrossentropy(from_logits=True))
  return model


def token_dataset(args):
  """Endless fixed-size batches of random (tokens, mask), next tokens."""
  rng = np.random.default_rng(args.seed)
  text = rng.integers(1, args.vocab, size=(8 * args.global_batch,
                                           args.sequence + 1)).astype("int32")
  inputs = {"token_ids": text[:, :-1],
            "padding_mask": np.ones_like(text[:, :-1])}
  return tf.data.Dataset.from_tensor_slices((inputs, text[:, 1:])).repeat(
      ).batch(args.global_batch, drop_remainder=True)


def timed_fit(model, dataset, args):
  timer = common.StepTimer(args.skip_steps)
  model.fit(dataset, epochs=1, steps_per_epoch=args.steps,
            callbacks=[timer.callback], verbose=0)
  return timer.step_time(args.steps)


@contextlib.contextmanager
def collective_counter():
  """{(device index, kind): bytes sent} by the collectives of the steps
  traced inside, counted when they run (a per-device counter variable
  incremented after each collective); filled in when the block ends."""
  counters = {}
  with tf.init_scope():
    for index, device in enumerate(tf.config.list_logical_devices("CPU")):
      for kind, _, _ in SENT.values():  # Not trainable: tfpar's custom
        with tf.device(device.name):     # gradients take no variables.
          counters[(index, kind)] = tf.Variable(0, dtype=tf.int64,
                                                trainable=False)
  originals = {name: getattr(collective_ops, name) for name in SENT}

  def wrapped(name):
    kind, numerator, denominator = SENT[name]

    def collective(t, group_size, *args, **kwargs):
      result = originals[name](t, group_size, *args, **kwargs)
      if tf.executing_eagerly():
        return result
      g = tf.cast(group_size, tf.int64)
      sent = (tf.size(t, out_type=tf.int64) * t.dtype.size * numerator(g)
              // denominator(g))
      index = tf.DeviceSpec.from_string(result.device).device_index
      with tf.control_dependencies([result]):
        update = counters[(index, kind)].assign_add(sent)
      with tf.control_dependencies([update]):
        return tf.identity(result)
    return collective

  totals = {}
  for name in SENT:
    setattr(collective_ops, name, wrapped(name))
  try:
    yield totals
  finally:
    for name, original in originals.items():
      setattr(collective_ops, name, original)
    totals.update({key: int(v.numpy()) for key, v in counters.items()})


def memory(model):
  """{part: [bytes on each device, in device order]}, counted from the
  variables' per-device components; and tfpar's own count to compare."""
  def per_device(variables):
    found = collections.Counter()
    for variable in variables:
      value = getattr(variable, "_value", variable)
      for c in getattr(value, "values", (value,)):  # One per device.
        found[tf.DeviceSpec.from_string(c.device).to_string()] += (
            c.shape.num_elements() * c.dtype.size)
    return [n for _, n in sorted(found.items())]
  is_expert = lambda v: "experts" in v.path  # Weights and their slots.
  weights, slots = model.weights, model.optimizer.variables
  parts = {"expert weights": [v for v in weights if is_expert(v)],
           "expert weights + slots": [v for v in weights + slots
                                      if is_expert(v)],
           "all variables": weights + slots}
  found = {part: per_device(v) for part, v in parts.items()}
  report = tfpar.memory_report(model)
  found["tfpar.memory_report"] = [report.total(d) for d in report.devices]
  return found


def formulas(args, expert, model):
  """Bytes each device sends per step, by the formulas of the docstring
  (the embedding's looked-up rows are all-gathered, not all-reduced)."""
  tokens = args.global_batch // NUM_DEVICES * args.sequence
  capacity = tokens if args.capacity_factor is None else math.ceil(
      args.capacity_factor * tokens * args.top_k / args.experts)
  share = 4 * args.layers * args.hidden * 4 * (expert - 1) / expert
  size = lambda s: sum(v.shape.num_elements() for v in model.trainable_weights
                       if s(v.path))
  experts = size(lambda p: "/experts/" in p)
  dense = size(lambda p: not p.endswith("token_embedding/embeddings"))
  ring = lambda n, g: n * 2 * (g - 1) / g * 4
  router = 2 * args.layers * (args.top_k * args.experts + args.experts + 1)
  reduced = ring(dense, NUM_DEVICES) if expert == 1 else (
      ring(dense - experts + router, NUM_DEVICES) +
      ring(experts, NUM_DEVICES // expert))
  return {"all-reduce": reduced, "all-to-all": share * args.experts * capacity,
          "textbook": share * tokens}


def row(*cells):
  """Prints a markdown table row (and the rule under a header row)."""
  print("| " + " | ".join(str(c) for c in cells) + " |")
  if cells[0] == "layout":
    print("|---|" + "---:|" * (len(cells) - 1))


def cell(values):
  """The value on device 0, with the range when the devices differ."""
  spread = f" ({min(values):,.0f}-{max(values):,.0f})"
  return f"{values[0]:,.0f}" + (spread if len(set(values)) > 1 else "")


def main(argv=None):
  args = parse_args(argv)
  cpus = tfpar.configure_virtual_cpus(NUM_DEVICES)
  mesh = tfpar.Mesh({"data": NUM_DEVICES})
  strategies = {DP_NAME: (tfpar.DataParallelStrategy(mesh), 1), **{
      f"expert {e}": (tfpar.ExpertParallelStrategy(
          mesh, expert=e, capacity_factor=args.capacity_factor), e)
      for e in (2, 4)}}
  dataset = token_dataset(args)
  models, sent, logged, memories, formula = {}, {}, {}, {}, {}
  for name, (strategy, expert) in strategies.items():
    models[name] = model = build_model(strategy, args)
    # Traced and run with the counter; then traced again without it.
    with collective_counter() as counted, tfpar.CommunicationLog() as log:
      model.fit(dataset, epochs=1, steps_per_epoch=COUNTED_STEPS, verbose=0)
    model.make_train_function(force=True)
    devices = sorted({i for i, _ in counted})
    sent[name] = {kind: [counted[(i, kind)] / COUNTED_STEPS for i in devices]
                  for kind, _, _ in SENT.values()}
    logged[name] = collections.Counter()
    for (kind, _), nbytes in log.bytes(0).items():
      logged[name][kind] += nbytes
    memories[name] = memory(model)
    formula[name] = formulas(args, expert, model)
    if expert > 1:  # Nothing dropped with C = T.
      print(name, strategy.routing_report(), file=sys.stderr)
    timed_fit(model, dataset, args)  # Trace + warm-up, untimed.

  times = common.alternating_times(
      models, args.runs, lambda name: timed_fit(models[name], dataset, args))

  medians = {name: statistics.median(t) for name, t in times.items()}
  ratio = {name: common.ratios(t, times[DP_NAME]) for name, t in times.items()}
  num_params = models[DP_NAME].count_params()
  print(f"\n{NUM_DEVICES} virtual CPUs, Mixtral LM with {num_params:,} "
        f"parameters, {args.steps - args.skip_steps} timed steps per run, "
        f"{args.runs} runs; flags {vars(args)}\n")
  row("layout", "median step time (ms)", "min (ms)", "max (ms)",
      "ratio of medians / data", "median per-run ratio / data", "runs")
  for name, t in times.items():
    row(name, f"{medians[name] * 1e3:.2f}", f"{min(t) * 1e3:.2f}",
        f"{max(t) * 1e3:.2f}", f"{ratio[name][0]:.3f}",
        f"{ratio[name][1]:.3f}", len(t))

  print("\nbytes per device (device 0; the range when devices differ)\n")
  parts = list(memories[DP_NAME])
  row("layout", *parts, "all variables / data")
  for name, found in memories.items():
    share = found["all variables"][0] / memories[DP_NAME]["all variables"][0]
    row(name, *(cell(found[p]) for p in parts), f"{share:.3f}")

  print("\nbytes sent per device and step (counted: run-time counter, "
        "device 0; log: CommunicationLog, replica 0)\n")
  row("layout", "all-reduce counted", "all-reduce log", "all-reduce formula",
      "all-gather counted", "all-to-all counted", "all-to-all log",
      "all-to-all formula E C h 4 (e-1)/e", "textbook T h 4 (e-1)/e",
      "total counted")
  for name, count in sent.items():
    row(name, cell(count["all-reduce"]), f"{logged[name]['all-reduce']:,}",
        f"{formula[name]['all-reduce']:,.0f}", cell(count["all-gather"]),
        cell(count["all-to-all"]), f"{logged[name]['all-to-all']:,}",
        f"{formula[name]['all-to-all']:,.0f}",
        f"{formula[name]['textbook']:,.0f}",
        f"{sum(v[0] for v in count.values()):,.0f}")

  x, y = next(iter(dataset))
  flops, _, _ = bounds.model_flops(lambda s: build_model(s, args), x, y)
  machine = bounds.Machine((args.global_batch // NUM_DEVICES * args.sequence,
                            args.hidden, args.intermediate), cpus)
  # Bytes: every collective every device ran, as counted at run time.
  bound = bounds.table(machine, {
      name: (flops, sum(sum(v) for v in sent[name].values()), t)
      for name, t in times.items()})

  common.write_json(args.output, {
      "physical_bound": bound,
      "benchmark": "expert_parallel", "num_params": num_params,
      "args": vars(args), "step_times_s": times, "median_step_time_s": medians,
      "ratio_over_data": {n: r[0] for n, r in ratio.items()},
      "median_per_run_ratio_over_data": {n: r[1] for n, r in ratio.items()},
      "bytes_per_device": memories, "sent_per_device_and_step": sent,
      "communication_log_replica0": logged, "formulas": formula,
  })


if __name__ == "__main__":
  main()
