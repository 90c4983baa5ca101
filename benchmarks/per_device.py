"""Bytes and work per device of one training step, two designs side by
side (`bench_expert_tensor_spmd.py`, `bench_three_d_spmd.py`).

Bytes a device sends are counted two independent ways: its collectives
when they run (`bench_expert_parallel.collective_counter`: each device
adds what it sends to a counter variable), and the cross-device copies of
the traced step graph (`census.copied_bytes`). Work is the census of one
traced training step (`census.py`).
"""

import bench_expert_parallel as moe_bench  # pylint: disable=g-import-not-at-top
import census as census_lib  # pylint: disable=g-import-not-at-top


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
