"""Worker script for the multi-worker SPMD tensor-parallel test.

Trains tp_common's GPT (global_clipnorm 0.5) under
TensorParallelStrategy(spmd=True): tensor 2 inside each worker, data across
workers. Writes what the worker saw (`tp_common.worker_result`, plus
`get_weights`) to `<out_dir>/worker<i>.json`; the chief also saves the
weights.

Usage: tp_spmd_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar  # pylint: disable=g-import-not-at-top
import tp_common


def main():
  out_dir = sys.argv[1]
  mesh = tfpar.Mesh.from_cluster_resolver(data=-1, tensor=2)
  strategy = tfpar.TensorParallelStrategy(mesh, spmd=True)
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(), global_clipnorm=0.5)
  result = tp_common.worker_result(strategy, model, predict_count=20)
  if mesh.cluster.is_chief:
    model.save_weights(os.path.join(out_dir, "weights.weights.h5"))
  result["get_weights"] = [w.tolist() for w in model.get_weights()]
  with open(os.path.join(out_dir, f"worker{mesh.cluster.task_id}.json"),
            "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
