"""Worker script for expert parallelism across `TF_CONFIG` workers, run by
`tfpar launch` (2 workers x 2 virtual CPUs).

Trains test_moe_layer's model (two `tfpar.MoE` layers, Adam) on one device
and under `ExpertParallelStrategy` with expert 2 (each expert group inside
a worker) and expert 4 (the group spans both workers), and writes to
`OUT_DIR/worker<i>.json` the largest differences from one device and what
`get_weights` said.

Usage: ep_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top

import test_moe_layer  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top


def main():
  out_dir = sys.argv[1]
  task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  mesh = tfpar.Mesh.from_cluster_resolver(data=-1)
  # The first strategy before any op: TF configures collectives at startup.
  strategies = {2: tfpar.ExpertParallelStrategy(mesh, expert=2)}
  reference, reference_losses = test_moe_layer.train("adam")
  result = {}
  for expert in (2, 4):
    strategy = (strategies.get(expert) or
                tfpar.ExpertParallelStrategy(mesh, expert=expert))
    model, losses = test_moe_layer.train("adam", strategy)
    found = {"losses": float(np.abs(losses - reference_losses).max())}
    try:
      found["weights"] = max(
          float(np.abs(a - b).max())
          for a, b in zip(model.get_weights(), reference.get_weights()))
    except ValueError as refused:
      found["get_weights error"] = str(refused)
    result[str(expert)] = found
  with open(os.path.join(out_dir, f"worker{task}.json"), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
