"""Step time of `TensorParallelStrategy` (data 2 x tensor 2) vs
`DataParallelStrategy` (data 4), and the tensor-parallel bytes per step.

Trains the same small GPT (token and position `Embedding`s, pre-LayerNorm
blocks of causal `MultiHeadAttention` and a GELU MLP, a final LayerNorm and
a vocabulary head; stock Keras layers, Adam) in one process with 4 virtual
CPUs, under `tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
"tensor": 2}))` and under `tfpar.DataParallelStrategy(tfpar.Mesh({"data":
4}))`, with the same global batch of random tokens from a fixed seed
(`tf.data`, `drop_remainder=True`). The tensor-parallel model uses the
built-in plan plus one `ShardingPlan` rule that makes the vocabulary head
column-parallel, as in `examples/train_char_lm_tensor_parallel.py`.

Each model is compiled and warmed up once, then the two are measured in
alternating runs of `model.fit` (the order flips from run to run). A run's
step time is the wall time from the start of batch `--skip-steps` to the end
of the epoch, divided by the steps in between. Prints a markdown table with
the median step time of each strategy and the ratio tensor / data parallel:
of the medians, and the median over runs of the per-run ratios.

The tensor-parallel model's first step runs inside a
`tfpar.CommunicationLog`, which gives the bytes replica 0 moves inside its
tensor group in one step. They are grouped by the layer that moves them:
transformer blocks, embeddings and head. The blocks are compared with
Megatron-LM's count for this layout: per block and step, 2 reduces and
2 broadcasts forward and 2 of each backward (8 ops), each moving (t - 1)
copies of one activation of B x S x W float32 values (B the per-replica
batch, S the sequence, W the width):

    bytes per block per step = 8 (t - 1) B S W 4

The data-axis gradient all-reduce, which both strategies do, is not part of
these counts. It is part of each strategy's physical bound (`bounds.py`),
printed last with the ratio median step time / bound.

Run from the repository root:

    python benchmarks/bench_tensor_vs_data_parallel.py
    python benchmarks/bench_tensor_vs_data_parallel.py --runs 5 \
        --steps 60 --output /tmp/tp_vs_dp.json
"""

import argparse
import collections
import os
import re
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
TENSOR = 2
FLOAT32_BYTES = 4
TP_NAME = "tfpar.TensorParallelStrategy"
DP_NAME = "tfpar.DataParallelStrategy"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=15, steps=60)
  common.add_global_batch_flag(parser, 32, unit="sequences")
  common.add_gpt_flags(parser)
  return common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)


def gpt(args):
  """A small GPT from stock Keras layers (as in the char-LM example)."""
  import keras  # pylint: disable=g-import-not-at-top
  tokens = keras.Input((args.sequence,), dtype="int32")
  x = keras.layers.Embedding(args.vocab, args.width, name="tokens")(tokens)
  positions = keras.ops.zeros_like(tokens) + keras.ops.arange(args.sequence)
  x = x + keras.layers.Embedding(args.sequence, args.width,
                                 name="positions")(positions)
  for b in range(args.blocks):
    h = keras.layers.LayerNormalization(name=f"block{b}_ln1")(x)
    h = keras.layers.MultiHeadAttention(
        args.heads, args.width // args.heads,
        name=f"block{b}_attention")(h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(name=f"block{b}_ln2")(x)
    h = keras.layers.Dense(4 * args.width, activation="gelu",
                           name=f"block{b}_mlp_in")(h)
    x = x + keras.layers.Dense(args.width, name=f"block{b}_mlp_out")(h)
  x = keras.layers.LayerNormalization(name="final_ln")(x)
  logits = keras.layers.Dense(args.vocab, name="lm_head")(x)
  return keras.Model(tokens, logits, name="gpt")


def build_model(strategy, args):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(args.seed)  # the same weights under both
  with strategy.scope():
    model = gpt(args)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def token_dataset(args):
  """Endless fixed-size batches of random (tokens, next tokens)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed)
  text = rng.integers(0, args.vocab, size=(8 * args.global_batch,
                                           args.sequence + 1)).astype("int32")
  return tf.data.Dataset.from_tensor_slices(
      (text[:, :-1], text[:, 1:])).repeat().batch(
          args.global_batch, drop_remainder=True)


def timed_fit(model, dataset, args):
  timer = common.StepTimer(args.skip_steps)
  model.fit(dataset, epochs=1, steps_per_epoch=args.steps,
            callbacks=[timer.callback], verbose=0)
  return timer.step_time(args.steps)


def part_of(layer):
  """The part of the model a communicating layer belongs to."""
  found = re.match(r"block(\d+)_", layer)
  if found:
    return f"block {found.group(1)}"
  if layer in ("tokens", "positions"):
    return "embeddings"
  if layer == "lm_head":
    return "head"
  return layer


def communication(log):
  """{part: {"ops": {phase: n}, "bytes": total}} for replica 0's step, and
  {(kind, phase): (ops, bytes)}."""
  parts = collections.OrderedDict()
  for record in log.step_records(0):
    if record.bytes is None:
      raise ValueError(f"{record.kind} in {record.layer!r} has a dynamic "
                       f"shape; use fixed-size batches.")
    part = parts.setdefault(part_of(record.layer),
                            {"ops": collections.Counter(), "bytes": 0})
    part["ops"][record.phase] += 1
    part["bytes"] += record.bytes
  counts, nbytes = log.counts(0), log.bytes(0)
  by_kind = {key: (counts[key], nbytes[key]) for key in sorted(counts)}
  return parts, by_kind


def gradient_bytes(model, data):
  """Bytes all devices send per step to all-reduce the float32 gradients
  of the weights each device holds (`tfpar.memory_report`) over the
  `data` replicas, as dense ring all-reduces: the minimum; tfpar
  all-gathers the embeddings' looked-up rows instead, which is more."""
  report = tfpar.memory_report(model)
  return sum(bounds.ring_all_reduce_bytes(report.parameters.get(d, 0), data)
             for d in report.devices)


def physical_bound(args, devices, dataset, models, tensor_bytes, times):
  """Prints and returns the physical bound of each strategy's step (see
  bounds.py): the GPT's matmul FLOPs at the global batch; bytes: the
  gradient all-reduce over the data axis, plus for tensor parallelism the
  tensor-group traffic of replica 0 (CommunicationLog) times the data
  replicas."""
  x, y = next(iter(dataset))
  flops, _, _ = bounds.model_flops(lambda s: build_model(s, args), x, y)
  data = {TP_NAME: NUM_DEVICES // TENSOR, DP_NAME: NUM_DEVICES}
  machine = bounds.Machine(
      (args.global_batch // NUM_DEVICES * args.sequence, args.width,
       4 * args.width), devices)
  return bounds.table(machine, {
      name: (flops, tensor_bytes[name] + gradient_bytes(models[name],
                                                        data[name]), t)
      for name, t in times.items()})


def main(argv=None):
  args = parse_args(argv)
  devices = tfpar.configure_virtual_cpus(NUM_DEVICES)

  plan = tfpar.ShardingPlan([(r"^lm_head/", tfpar.ColumnParallel())])
  strategies = {
      TP_NAME: tfpar.TensorParallelStrategy(
          tfpar.Mesh({"data": NUM_DEVICES // TENSOR, "tensor": TENSOR}),
          plan=plan),
      DP_NAME: tfpar.DataParallelStrategy(tfpar.Mesh({"data": NUM_DEVICES})),
  }
  dataset = token_dataset(args)
  models = {name: build_model(s, args) for name, s in strategies.items()}
  num_params = models[DP_NAME].count_params()

  # The tensor-parallel model's first (traced) step, counted.
  with tfpar.CommunicationLog() as log:
    models[TP_NAME].fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
  parts, by_kind = communication(log)
  for model in models.values():  # compile + trace, untimed
    timed_fit(model, dataset, args)

  times = common.alternating_times(
      models, args.runs, lambda name: timed_fit(models[name], dataset, args))

  medians = {name: statistics.median(t) for name, t in times.items()}
  ratio, paired = common.ratios(times[TP_NAME], times[DP_NAME])
  meshes = {TP_NAME: f"data {NUM_DEVICES // TENSOR} x tensor {TENSOR}",
            DP_NAME: f"data {NUM_DEVICES}"}
  print(f"\n{NUM_DEVICES} virtual CPUs, GPT with {num_params:,} parameters "
        f"({args.blocks} blocks, width {args.width}, {args.heads} heads, "
        f"sequence {args.sequence}, vocabulary {args.vocab}), global batch "
        f"{args.global_batch}, {args.steps - args.skip_steps} timed steps "
        f"per run, {args.runs} runs each\n")
  print("| strategy | mesh | median step time (ms) | min (ms) | max (ms) | "
        "runs |")
  print("|---|---|---:|---:|---:|---:|")
  for name, t in times.items():
    print(f"| `{name}` | {meshes[name]} | {medians[name] * 1e3:.2f} | "
          f"{min(t) * 1e3:.2f} | {max(t) * 1e3:.2f} | {len(t)} |")
  print(f"\nratio tensor / data parallel, of the median step times: "
        f"{ratio:.3f}; median of the per-run ratios: {paired:.3f}")

  per_replica_batch = args.global_batch // (NUM_DEVICES // TENSOR)
  activation = per_replica_batch * args.sequence * args.width * FLOAT32_BYTES
  per_block = 8 * (TENSOR - 1) * activation
  blocks = [p for p in parts if p.startswith("block ")]
  measured_blocks = sum(parts[p]["bytes"] for p in blocks)
  formula_blocks = per_block * args.blocks
  print(f"\ntensor-group communication of replica 0 in one step "
        f"(tfpar.CommunicationLog; t = {TENSOR}, B = {per_replica_batch} per "
        f"replica, S = {args.sequence}, W = {args.width}; formula per block "
        f"8 (t-1) B S W 4 = {per_block:,} bytes)\n")
  print("| part | ops forward | ops backward | bytes measured | "
        "bytes by formula |")
  print("|---|---:|---:|---:|---:|")
  for name, part in parts.items():
    formula = f"{per_block:,}" if name in blocks else "-"
    print(f"| {name} | {part['ops']['forward']} | {part['ops']['backward']} | "
          f"{part['bytes']:,} | {formula} |")
  print(f"| **all {len(blocks)} blocks** | "
        f"{sum(parts[p]['ops']['forward'] for p in blocks)} | "
        f"{sum(parts[p]['ops']['backward'] for p in blocks)} | "
        f"**{measured_blocks:,}** | **{formula_blocks:,}** |")
  total = sum(p["bytes"] for p in parts.values())
  print(f"| **step total** | | | **{total:,}** | |")
  print("\n| kind | phase | ops | bytes |")
  print("|---|---|---:|---:|")
  for (kind, phase), (ops, nbytes) in by_kind.items():
    print(f"| {kind} | {phase} | {ops} | {nbytes:,} |")
  print(f"\nblocks: measured / formula = "
        f"{measured_blocks / formula_blocks:.3f}")

  total_bytes = {TP_NAME: total * (NUM_DEVICES // TENSOR), DP_NAME: 0}
  bound = physical_bound(args, devices, dataset, models, total_bytes, times)

  common.write_json(args.output, {
      "physical_bound": bound,
      "benchmark": "tensor_vs_data_parallel", "devices": NUM_DEVICES,
      "tensor": TENSOR, "num_params": num_params,
      "global_batch": args.global_batch, "sequence": args.sequence,
      "width": args.width, "heads": args.heads, "blocks": args.blocks,
      "vocab": args.vocab,
      "timed_steps_per_run": args.steps - args.skip_steps,
      "runs": args.runs, "step_times_s": times,
      "median_step_time_s": medians,
      "ratio_tensor_over_data": ratio,
      "median_per_run_ratio_tensor_over_data": paired,
      "communication_bytes_per_step": {
          name: part["bytes"] for name, part in parts.items()},
      "communication_ops_per_step": {
          name: dict(part["ops"]) for name, part in parts.items()},
      "communication_by_kind": {
          f"{kind}/{phase}": {"ops": ops, "bytes": nbytes}
          for (kind, phase), (ops, nbytes) in by_kind.items()},
      "block_bytes_measured": measured_blocks,
      "block_bytes_formula": formula_blocks,
      "total_bytes_measured": total,
  })


if __name__ == "__main__":
  main()
