"""Worker script for the multi-worker tensor-parallel test.

Trains tp_common's GPT under TensorParallelStrategy (tensor 2 inside each
worker, data across workers) and writes what the worker saw to
`<out_dir>/worker<i>.json`; the chief also saves the weights.

Usage: tp_worker.py OUT_DIR
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
  strategy = tfpar.TensorParallelStrategy(mesh)
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(), global_clipnorm=0.5)
  x, y = tp_common.data("gpt")
  losses = tp_common.step_losses(model, x, y)
  px, py = tp_common.data("gpt", count=20, seed=7)
  result = {
      "num_replicas": strategy.num_replicas_in_sync,
      "groups": [list(g) for g in strategy.extended.replica_device_groups],
      "losses": losses.tolist(),
      "evaluate": model.evaluate(px, py, batch_size=8, verbose=0),
      "predict": model.predict(px, batch_size=8, verbose=0).tolist(),
      "weights": {k: v.tolist()
                  for k, v in tfpar.logical_weights(model).items()},
  }
  if mesh.cluster.is_chief:
    model.save_weights(os.path.join(out_dir, "weights.weights.h5"))
  with open(os.path.join(out_dir, f"worker{mesh.cluster.task_id}.json"),
            "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
