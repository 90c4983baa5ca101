"""Bytes and work per device of one training step, two designs side by
side (`bench_expert_tensor_spmd.py`, `bench_three_d_spmd.py`).

Bytes a device sends are counted two independent ways: its collectives
when they run (`bench_expert_parallel.collective_counter`: each device
adds what it sends to a counter variable), and the cross-device copies of
the traced step graph (`census.copied_bytes`). Work is the census of one
traced training step (`census.py`).
"""

import statistics

import bench_expert_parallel as moe_bench  # pylint: disable=g-import-not-at-top
import census as census_lib  # pylint: disable=g-import-not-at-top
import common  # pylint: disable=g-import-not-at-top


def measure(model, strategy, dataset, devices, steps=2):
  """({device: bytes its collectives sent per step}, {device: bytes it
  copied to other devices per step}, census) of `model`'s training step
  (`steps` steps counted; `dataset` batches of the global batch)."""
  with moe_bench.collective_counter() as counted:
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
  collectives = {d: sum(n for (i, _), n in counted.items()
                        if f"CPU:{i}" == d) // steps for d in devices}
  graph = census_lib.train_step_graph(model, strategy, dataset.take(1))
  copies = census_lib.copied_bytes(graph)
  return (collectives, {d: copies.get(d, 0) for d in devices},
          census_lib.census(graph))


def print_tables(devices, results):
  """Prints the bytes table and the census table of `results` ({design:
  measure()'s triple}); returns {f"{design} {key}": busiest over mean}."""
  print("| design | device | collectives sent | copies sent | total |")
  print("|---|---|---:|---:|---:|")
  for design, (collectives, copies, _) in results.items():
    for d in devices:
      print(f"| {design} | {d} | {collectives[d]:,} | {copies[d]:,} | "
            f"{collectives[d] + copies[d]:,} |")
  print("\n| census (one traced train step) | design | " +
        " | ".join(devices) + " | busiest vs mean |")
  print("|---|---|" + "---:|" * (len(devices) + 1))
  summary = {}
  for key in census_lib.KEYS[:3]:
    for design, (_, _, stats) in results.items():
      over = census_lib.busiest_over_mean(stats, devices, key)
      summary[f"{design} {key}"] = over
      print(f"| {key} | {design} | " + " | ".join(
          f"{stats[d][key]:,}" for d in devices) + f" | {over * 100:+.1f}% |")
  return summary


def timed_against_bound(models, measured, runs, timed_fit, machine):
  """Times `models` ({design: model}, "head" and "spmd") in alternating
  runs, prints each design's median step beside its physical bound (the
  census's matmul FLOPs at the machine's rate plus `measured`'s bytes at
  its copy bandwidth) and the ratio spmd / head; returns the results
  ready for JSON.

  Args:
    models: {design: a compiled model, traced and warmed up}.
    measured: {design: `measure()`'s triple}.
    runs: alternating runs.
    timed_fit: `timed_fit(model)` -> seconds per timed step.
    machine: a `bounds.Machine`.
  """
  times = common.alternating_times(models, runs,
                                   lambda name: timed_fit(models[name]))
  ratio, paired = common.ratios(times["spmd"], times["head"])
  print("\n| design | median step (ms) | min (ms) | max (ms) | runs | "
        "matmul FLOPs / step | bytes sent / step | bound (ms) | "
        "step / bound |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  bound_rows = {}
  for design, t in times.items():
    collectives, copies, stats = measured[design]
    flops = sum(c["matmul_flops"] for c in stats.values())
    nbytes = sum(collectives.values()) + sum(copies.values())
    _, _, bound = machine.bound(flops, nbytes)
    median = statistics.median(t)
    bound_rows[design] = {"flops": flops, "bytes": nbytes, "bound_s": bound,
                          "ratio": median / bound}
    print(f"| {design} | {median * 1e3:.2f} | {min(t) * 1e3:.2f} | "
          f"{max(t) * 1e3:.2f} | {len(t)} | {flops / 1e6:,.1f} M | "
          f"{nbytes:,} | {bound * 1e3:.2f} | {median / bound:.1f} |")
  print(f"\nratio spmd / head: of the medians {ratio:.3f}, median of the "
        f"per-run ratios {paired:.3f}")
  return {"sent": {d: {"collectives": c, "copies": k}
                   for d, (c, k, _) in measured.items()},
          "times": times, "ratio_of_medians": ratio,
          "median_of_ratios": paired, "bound": bound_rows}
