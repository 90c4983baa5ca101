"""Worker script for expert parallelism across `TF_CONFIG` workers, run by
`tfpar launch` (2 workers x 2 virtual CPUs).

Trains test_moe_layer's model (two `tfpar.MoE` layers, Adam) on one device
and under `ExpertParallelStrategy` with expert 2 (each expert group inside
a worker), expert 4 (the group spans both workers) and expert 2 x tensor 2
(SPMD; each worker one tensor group, each expert group across both
workers), and writes to
`OUT_DIR/worker<i>.json` the largest differences from one device of the
losses and of `get_weights` (gathered across the workers for expert 4 and 2 x 2),
the difference of `model.weights`' values from `get_weights`,
and (chief) of a one-device model loading what `tfpar.save_weights`
wrote.

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
  # Expert 2 x tensor 2 (SPMD): each worker's 2 devices are one tensor
  # group, and each expert group spans both workers.
  by_tensor = tfpar.Mesh.from_cluster_resolver(data=2, tensor=2)
  result = {}
  for expert in (2, 4, "2x2"):
    strategy = strategies.get(expert) or (
        tfpar.ExpertParallelStrategy(by_tensor, expert=2)
        if expert == "2x2" else
        tfpar.ExpertParallelStrategy(mesh, expert=expert))
    model, losses = test_moe_layer.train("adam", strategy)
    found = {"losses": float(np.abs(losses - reference_losses).max())}
    # Every worker reads (and with expert 4 gathers) the whole experts.
    weights = model.get_weights()
    found["weights"] = max(
        float(np.abs(a - b).max())
        for a, b in zip(weights, reference.get_weights()))
    found["shapes"] = [list(w.shape) for w in weights] == [
        list(w.shape) for w in reference.get_weights()]
    # Keras's own list, read one weight at a time (with expert 4 each
    # expert weight's numpy() gathers from both workers).
    listed = [w.numpy() for w in model.weights]
    found["listed"] = (
        [tuple(w.shape) for w in model.weights] ==
        [tuple(w.shape) for w in reference.weights] and max(float(np.abs(a - b).max()) for a, b in zip(listed, weights)))
    path = os.path.join(out_dir, f"expert{expert}.weights.h5")
    tfpar.save_weights(model, path)  # Every worker; the chief writes.
    if task == 0:
      reloaded = test_moe_layer.moe_model()
      reloaded.load_weights(path)
      found["saved"] = max(
          float(np.abs(a - b).max())
          for a, b in zip(reloaded.get_weights(), weights))
    result[str(expert)] = found
  with open(os.path.join(out_dir, f"worker{task}.json"), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
