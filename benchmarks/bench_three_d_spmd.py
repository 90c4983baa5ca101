"""3D (pipeline x tensor), SPMD vs the head design: bytes and work per
device.

Trains benchmark 3's GPT (`bench_tensor_vs_data_parallel.py`: 2 blocks,
width 128, 4 heads, sequence 64, vocabulary 96, Adam) in one process on 4
virtual CPUs under `tfpar.PipelineParallelStrategy` on data 1 x
pipeline 2 x tensor 2 (1F1B, 4 micro-batches), with `spmd=False` (the
replica-head design: each stage's first device runs the replicated work
and reduces onto itself, then broadcasts, for its tensor group) and
`spmd=True` (the default: a trace per tensor column runs the schedule on
its column of every stage; each stage's tensor-parallel reductions are
collectives of its group). For each design (`per_device.py`):

* bytes each device sends in one step: its collectives when they run,
  and the cross-device copies of the traced step graph (the head design's
  reduces and broadcasts; both designs' activations between stages);
* a census of one traced training step per device: ops, matmul FLOPs,
  element-wise output elements, and how far the busiest device is above
  the mean;
* step time in alternating runs (order flipped every run), medians and
  the ratio spmd / head, and the physical bound (`bounds.py`).

Command (from the repository root):

    python benchmarks/bench_three_d_spmd.py --runs 7 \\
        --output /tmp/three_d_spmd.json
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_tensor_vs_data_parallel as gpt_bench  # pylint: disable=g-import-not-at-top
import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import per_device  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
MESH = {"data": 1, "pipeline": 2, "tensor": 2}
DESIGNS = ("head", "spmd")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser, runs=7, steps=30)
  common.add_global_batch_flag(parser, 32, unit="sequences")
  common.add_gpt_flags(parser)
  parser.add_argument("--microbatches", type=int, default=4)
  return common.parse_checked(parser, argv,
                              batch_multiple=MESH["data"] * 4)


def build(design, args):
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh(MESH), num_microbatches=args.microbatches,
      schedule="1f1b", spmd=design == "spmd")
  return strategy, gpt_bench.build_model(strategy, args)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  all_devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  devices = [f"CPU:{i}" for i in range(NUM_DEVICES)]
  dataset = gpt_bench.token_dataset(args)
  machine = bounds.Machine(
      (args.global_batch // args.microbatches * args.sequence, args.width,
       4 * args.width), all_devices)
  print(machine.describe())
  print(f"\n## data 1 x pipeline 2 x tensor 2, 1F1B, {args.microbatches} "
        f"micro-batches\n")
  built = {d: build(d, args) for d in DESIGNS}
  measured = {d: per_device.measure(m, s, dataset, devices)
              for d, (s, m) in built.items()}
  summary = per_device.print_tables(devices, measured)
  models = {d: m for d, (_, m) in built.items()}
  for model in models.values():  # Warm up (traced above).
    gpt_bench.timed_fit(model, dataset, args)
  result = per_device.timed_against_bound(
      models, measured, args.runs,
      lambda model: gpt_bench.timed_fit(model, dataset, args), machine)
  common.write_json(args.output, dict(
      result, benchmark="three_d_spmd", census=summary,
      machine={"flops_per_second": machine.flops_per_second(),
               "copy_bytes_per_second": machine.bandwidth}))


if __name__ == "__main__":
  main()
