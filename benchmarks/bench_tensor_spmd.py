"""Tensor parallelism with every device tracing the step
(`TensorParallelStrategy(..., spmd=True)`, also with
`sequence_parallel=True`) vs the head design (default): bytes per device,
work per device, step time.

Trains the small GPT of benchmark 3 (`bench_tensor_vs_data_parallel.gpt`,
built-in plan: embeddings split on the vocabulary, attention by heads, the
MLP column/row; LayerNorms, residuals and the vocabulary head replicated)
in one process with 4 virtual CPUs, for tensor 2 (mesh data 2 x tensor 2)
and tensor 4 (data 1 x tensor 4), in both designs, with the same global
batch and initial weights. For each tensor size it prints:

* bytes each device sends inside its tensor group in one step. SPMD:
  TensorFlow's own count of what each rank of each tensor group's ring
  sends (a child process run with `TF_CPP_VMODULE=ring_alg=3` logs every
  chunk; the data-axis gradient all-reduce is left out by group key), and
  tfpar's `CommunicationLog`, both against the ring formula
  2 (t - 1) / t x activation per all-reduce (activation = B S W 4 bytes,
  B the per-replica batch). Head design: from the `CommunicationLog`, each
  op's bytes charged to the device that sends them (the head sends every
  broadcast and scatter, each other device its part of every reduce and
  gather). SPMD with sequence parallelism: from the `CommunicationLog`
  (each reduce-scatter and all-gather sends (t - 1) / t of its activation);
* a census of one traced training step (forward, backward, gradient
  all-reduce, optimizer): ops, matmul FLOPs and element-wise output
  elements per device, and how much the busiest device exceeds the mean;
* the step time of each design in alternating runs of `model.fit` (order
  flipped from run to run), medians, and the ratios spmd / head and
  spmd-sp / head: of the medians and the median of the per-run ratios.

Last, each design's physical bound at each tensor size (`bounds.py`,
measured after the timed runs of both tensor sizes) and the ratio median
step time / bound. FLOPs: the matmul FLOPs of the design's own traced
step, the census summed over all devices (SPMD repeats the replicated
layers' matmuls, the vocabulary head's, on every device of a group; the
one-device graph's count, `bounds.model_flops`, is printed beside them).
Bytes, summed over the devices: the tensor-group traffic above (head and
spmd-sp: the log; spmd: TF's ring) plus the float32 ring all-reduce of
each device's gradients over the data axis (`gradient_bytes` of
benchmark 3: every device all-reduces the weights it holds, so under SPMD
also its copy of each replicated weight). R: the matmul rate of
benchmark 3's shape (per-device rows x width x 4 width).

Run from the repository root:

    python benchmarks/bench_tensor_spmd.py
    python benchmarks/bench_tensor_spmd.py --runs 7 --steps 30 \
        --output /tmp/tensor_spmd.json
"""

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_tensor_vs_data_parallel as gpt_bench  # pylint: disable=g-import-not-at-top
import bounds  # pylint: disable=g-import-not-at-top
import census as census_lib  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
TENSORS = (2, 4)
DESIGNS = ("head", "spmd", "spmd-sp")
MARK = "TFPAR-SPMD-STEP"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=7, steps=30)
  common.add_global_batch_flag(parser, 32, unit="sequences")
  common.add_gpt_flags(parser)
  parser.add_argument("--ring-child", type=int, default=0,
                      help=argparse.SUPPRESS)
  return common.parse_checked(parser, argv, batch_multiple=NUM_DEVICES)


def mesh(tensor):
  return tfpar.Mesh({"data": NUM_DEVICES // tensor, "tensor": tensor})


def build(design, tensor, args):
  strategy = tfpar.TensorParallelStrategy(
      mesh(tensor), spmd=design != "head",
      sequence_parallel=design == "spmd-sp")
  return strategy, gpt_bench.build_model(strategy, args)


def activation_bytes(tensor, args):
  replica_batch = args.global_batch // (NUM_DEVICES // tensor)
  return replica_batch * args.sequence * args.width * 4


def logged_bytes(design, strategy, log):
  """{device: bytes it sends in one step} over every replica's group, from
  tfpar's CommunicationLog, and the number of all-reduces per device."""
  sent = collections.Counter()
  count = collections.Counter()
  for replica, group in enumerate(strategy.mesh.replicas):
    group = [census_lib._device(d) for d in group]  # pylint: disable=protected-access
    for record in log.step_records(replica):
      if design != "head":
        device = census_lib._device(record.tensor.device)  # pylint: disable=protected-access
        sent[device] += record.bytes
        count[device] += 1
      elif record.kind in ("broadcast", "scatter"):
        sent[group[0]] += record.bytes
      else:  # reduce, gather: every other device sends its part.
        for device in group[1:]:
          sent[device] += record.bytes // (len(group) - 1)
  return sent, count


def ring_child(args):
  """Runs in a child process with ring logging on: one SPMD step traced,
  then one step between markers."""
  tfpar.configure_virtual_cpus(NUM_DEVICES)
  strategy, model = build("spmd", args.ring_child, args)
  dataset = gpt_bench.token_dataset(args)
  model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
  keys = strategy.extended.tensor_groups.group_keys
  print(f"{MARK} begin keys={','.join(map(str, keys))}", file=sys.stderr,
        flush=True)
  model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
  print(f"{MARK} end", file=sys.stderr, flush=True)


def ring_bytes(tensor, argv):
  """{(group index, rank): bytes sent} in one SPMD step, from TF's ring
  (the child's tensor groups, in the mesh's replica order)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0",
             TF_CPP_VMODULE="ring_alg=3")
  child = subprocess.run(
      [sys.executable, os.path.abspath(__file__), *argv,
       "--ring-child", str(tensor)],
      env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
      check=True)
  inside, keys, sent = False, [], collections.Counter()
  for line in child.stderr.splitlines():
    if MARK in line:
      inside = "begin" in line
      if inside:
        keys = [int(k) for k in line.split("keys=")[1].split(",")]
      continue
    found = re.search(r"DispatchSend rank=(\d+) send key (\d+):\S* "
                      r"chunk \((\d+), (\d+)\)", line)
    if inside and found:
      rank, group, start, end = map(int, found.groups())
      if group in keys:
        sent[(keys.index(group), rank)] += end - start
  return sent


def census_of(model, strategy, args):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  dataset = gpt_bench.token_dataset(args).take(1)
  graph = census_lib.train_step_graph(model, strategy, dataset)
  del tf
  return census_lib.census(graph)


def bound_inputs(design, stats, model, tensor, tensor_bytes):
  """(matmul FLOPs summed over all devices of the traced step, bytes moved
  summed over all devices, {parts}) of one design's step."""
  flops = sum(counts["matmul_flops"] for counts in stats.values())
  gradients = gpt_bench.gradient_bytes(model, NUM_DEVICES // tensor)
  per_device = {d: c["matmul_flops"] for d, c in stats.items() if d}
  return flops, tensor_bytes + gradients, {
      "design": design, "tensor": tensor, "tensor_group_bytes": tensor_bytes,
      "gradient_allreduce_bytes": gradients,
      "matmul_flops_per_device": per_device,
      "busiest_device_matmul_flops": max(per_device.values())}


def physical_bound(args, devices, dataset, rows):
  """Prints and returns the physical bound (bounds.py) of each row
  {name: (flops, bytes, [seconds], parts)}: FLOPs at the machine's
  float32 matmul rate plus bytes at its copy bandwidth, and the ratio
  median step / bound; first each row's FLOPs against the one-device
  graph's count."""
  x, y = next(iter(dataset))
  one_device, _, _ = bounds.model_flops(
      lambda s: gpt_bench.build_model(s, args), x, y)
  print(f"\n## physical bound\n\nmatmul FLOPs of one step, summed over "
        f"the devices, against the one-device graph's "
        f"{one_device / 1e6:,.1f} M: " + "; ".join(
            f"{name} {row[0] / 1e6:,.1f} M ({row[0] / one_device:.3f}x)"
            for name, row in rows.items()))
  machine = bounds.Machine(
      (args.global_batch // NUM_DEVICES * args.sequence, args.width,
       4 * args.width), devices)
  rate, bandwidth = machine.flops_per_second(), machine.bandwidth
  print("\n" + machine.describe() + "\n")
  print("| tensor | design | FLOPs / step | bytes moved / step | R (GFLOP/s) | "
        "BW (GB/s) | compute bound (ms) | copy bound (ms) | bound (ms) | "
        "median step (ms) | step / bound |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  out = {"one_device_matmul_flops": one_device,
         "machine": {"shape": list(machine.shape), "cores": machine.cores,
                     "flops_per_second": rate,
                     "rates_one_and_all": machine.rates["float32"],
                     "copy_bytes_per_second": bandwidth}}
  for name, (flops, nbytes, seconds, parts) in rows.items():
    compute, copy, bound = machine.bound(flops, nbytes)
    median = statistics.median(seconds)
    out[name] = dict(parts, flops=flops, bytes=nbytes, dtype="float32",
                     flops_per_second=rate, bytes_per_second=bandwidth,
                     compute_s=compute, copy_s=copy, bound_s=bound,
                     median_step_s=median, ratio=median / bound)
    print(f"| {parts['tensor']} | {parts['design']} | {flops / 1e6:,.1f} M | "
          f"{nbytes:,} | {rate / 1e9:.1f} | {bandwidth / 1e9:.2f} | "
          f"{compute * 1e3:.2f} | {copy * 1e3:.2f} | {bound * 1e3:.2f} | "
          f"{median * 1e3:.2f} | {median / bound:.1f} |")
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.ring_child:
    return ring_child(args)
  all_devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  dataset = gpt_bench.token_dataset(args)
  result = {"benchmark": "tensor_spmd", "global_batch": args.global_batch}
  bound_rows = {}
  for tensor in TENSORS:
    built = {d: build(d, tensor, args) for d in DESIGNS}
    devices = [census_lib._device(d) for g in mesh(tensor).replicas  # pylint: disable=protected-access
               for d in g]
    activation = activation_bytes(tensor, args)
    ring_share = 2 * (tensor - 1) * activation / tensor
    print(f"\n## tensor {tensor} (mesh data {NUM_DEVICES // tensor} x "
          f"tensor {tensor}), activation B S W 4 = {activation:,} bytes, "
          f"ring share per all-reduce 2(t-1)/t x activation = "
          f"{ring_share:,.0f} bytes\n")
    sent = {}
    for design, (strategy, model) in built.items():
      with tfpar.CommunicationLog() as log:
        model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
      sent[design] = logged_bytes(design, strategy, log)
    ring = ring_bytes(tensor, argv)
    counts = sent["spmd"][1]
    print("| device | head: bytes sent (log) | spmd: all-reduces | "
          "spmd: bytes sent (TF ring) | spmd: bytes (log) | formula | "
          "ring / formula | spmd-sp: bytes (log) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ring_by_device = {}
    for index, device in enumerate(devices):
      # TF ranks a group's devices by name, as the mesh orders them here.
      ring_by_device[device] = ring[divmod(index, tensor)]
      formula = counts[device] * ring_share
      print(f"| {device} | {sent['head'][0][device]:,} | {counts[device]} | "
            f"{ring_by_device[device]:,} | {sent['spmd'][0][device]:,} | "
            f"{formula:,.0f} | {ring_by_device[device] / formula:.4f} | "
            f"{sent['spmd-sp'][0][device]:,} |")
    stats = {d: census_of(m, s, args) for d, (s, m) in built.items()}
    print("\n| census (one traced train step) | design | "
          + " | ".join(devices) + " | busiest vs mean |")
    print("|---|---|" + "---:|" * (len(devices) + 1))
    summary = {}
    for key in census_lib.KEYS[:3]:
      for design in DESIGNS:
        over = census_lib.busiest_over_mean(stats[design], devices, key)
        summary[f"{design} {key}"] = over
        print(f"| {key} | {design} | " + " | ".join(
            f"{stats[design][d][key]:,}" for d in devices) +
              f" | {over * 100:+.1f}% |")
    for design in DESIGNS:
      unplaced = stats[design].get(None)
      if unplaced:
        print(f"\n{design}: ops placed on no device: {dict(unplaced)}")
    tensor_bytes = {"head": sum(sent["head"][0].values()),
                    "spmd": sum(ring_by_device.values()),
                    "spmd-sp": sum(sent["spmd-sp"][0].values())}
    for design, (_, model) in built.items():
      flops, nbytes, parts = bound_inputs(design, stats[design], model,
                                          tensor, tensor_bytes[design])
      bound_rows[f"tensor {tensor}, {design}"] = [flops, nbytes, None, parts]
    models = {d: m for d, (_, m) in built.items()}
    for model in models.values():  # compile + trace, untimed
      gpt_bench.timed_fit(model, dataset, args)
    times = common.alternating_times(
        models, args.runs,
        lambda name: gpt_bench.timed_fit(models[name], dataset, args))
    ratio, paired = common.ratios(times["spmd"], times["head"])
    sp_ratio, sp_paired = common.ratios(times["spmd-sp"], times["head"])
    print("\n| design | median step (ms) | min (ms) | max (ms) | runs |")
    print("|---|---:|---:|---:|---:|")
    for design, t in times.items():
      print(f"| {design} | {statistics.median(t) * 1e3:.2f} | "
            f"{min(t) * 1e3:.2f} | {max(t) * 1e3:.2f} | {len(t)} |")
    for design, t in times.items():
      bound_rows[f"tensor {tensor}, {design}"][2] = t
    print(f"\nratio spmd / head: of the medians {ratio:.3f}, median of the "
          f"per-run ratios {paired:.3f}; spmd-sp / head: {sp_ratio:.3f}, "
          f"{sp_paired:.3f}")
    result[f"tensor{tensor}"] = {
        "ring_bytes": ring_by_device,
        "allreduces": dict(counts), "ring_share": ring_share,
        "head_bytes": dict(sent["head"][0]), "census": summary,
        "spmd_sp_bytes": dict(sent["spmd-sp"][0]),
        "times": times, "ratio_of_medians": ratio,
        "median_of_ratios": paired, "sp_ratio_of_medians": sp_ratio,
        "sp_median_of_ratios": sp_paired}
  result["physical_bound"] = physical_bound(
      args, all_devices, dataset, {name: tuple(row) for name, row in
                                   bound_rows.items()})
  common.write_json(args.output, result)


if __name__ == "__main__":
  main()
