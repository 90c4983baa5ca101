"""Expert x tensor, SPMD vs the head design: bytes and work per device.

Trains benchmark 8's keras-hub Mixtral (`bench_expert_parallel.py`) in one
process on 4 virtual CPUs under `tfpar.ExpertParallelStrategy` on
data 2 x tensor 2 (expert 2) and data 1 x tensor 4 (expert 1), with
`spmd=False` (the replica-head design: each replica's first device runs
the replicated work, routes, and forwards each tensor column's expert rows
to it) and `spmd=True` (the default: every device routes its copy of the
tokens and exchanges its own experts' rows; `spmd_exchange.py`). For each:

* bytes each device sends in one step, counted two independent ways
  (`per_device.py`): the collectives when they run, and the cross-device
  copies of the traced step graph (every tensor an op reads from another
  device);
* a census of one traced training step per device (`census.py`): ops,
  matmul FLOPs, element-wise output elements, and how far the busiest
  device is above the mean;
* step time in alternating runs (order flipped every run), medians and
  the ratio spmd / head;
* the physical bound (`bounds.py`): the step's matmul FLOPs (summed over
  the devices) at the machine's float32 rate plus the bytes sent at its
  copy bandwidth.

Command (from the repository root):

    python benchmarks/bench_expert_tensor_spmd.py --heads 8 --runs 7 \\
        --output /tmp/expert_tensor_spmd.json

(`--heads 8`: 4 key/value heads, which tensor 4 splits; keras-hub's
`CachedMixtralAttention` projections are split one by one.)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_expert_parallel as moe_bench  # pylint: disable=g-import-not-at-top
import bounds  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top
import per_device  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top

NUM_DEVICES = moe_bench.NUM_DEVICES
LAYOUTS = {2: 2, 4: 1}  # tensor size: expert size (data = 4 / tensor)
DESIGNS = ("head", "spmd")


def build(design, tensor, args):
  mesh = tfpar.Mesh({"data": NUM_DEVICES // tensor, "tensor": tensor})
  strategy = tfpar.ExpertParallelStrategy(
      mesh, expert=LAYOUTS[tensor], capacity_factor=args.capacity_factor,
      spmd=design == "spmd")
  return strategy, moe_bench.build_model(strategy, args)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = moe_bench.parse_args(argv)
  if (args.heads // 2) % max(LAYOUTS):
    raise SystemExit(f"--heads {args.heads} gives {args.heads // 2} key/value "
                     f"heads, which tensor {max(LAYOUTS)} cannot split; use "
                     f"--heads 8.")
  all_devices = tfpar.configure_virtual_cpus(NUM_DEVICES)
  devices = [f"CPU:{i}" for i in range(NUM_DEVICES)]
  dataset = moe_bench.token_dataset(args)
  result = {"benchmark": "expert_tensor_spmd"}
  machine = bounds.Machine(
      (args.global_batch // NUM_DEVICES * args.sequence, args.hidden,
       args.intermediate), all_devices)
  print(machine.describe())
  for tensor, expert in LAYOUTS.items():
    print(f"\n## data {NUM_DEVICES // tensor} x tensor {tensor}, expert "
          f"{expert}\n")
    built = {d: build(d, tensor, args) for d in DESIGNS}
    measured = {d: per_device.measure(m, s, dataset, devices,
                                      moe_bench.COUNTED_STEPS)
                for d, (s, m) in built.items()}
    summary = per_device.print_tables(devices, measured)
    models = {d: m for d, (_, m) in built.items()}
    for model in models.values():  # Warm up (traced above).
      moe_bench.timed_fit(model, dataset, args)
    result[f"tensor{tensor}"] = dict(
        per_device.timed_against_bound(
            models, measured, args.runs,
            lambda model: moe_bench.timed_fit(model, dataset, args),
            machine),
        expert=expert, census=summary)
  result["machine"] = {"flops_per_second": machine.flops_per_second(),
                       "copy_bytes_per_second": machine.bandwidth}
  common.write_json(args.output, result)


if __name__ == "__main__":
  main()
