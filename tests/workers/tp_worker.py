"""Worker script for the multi-worker tensor-parallel test.

Trains tp_common's GPT (global_clipnorm 0.5) under TensorParallelStrategy
(tensor 2 inside each worker, data across workers; with `spmd`, every
device tracing the step) and writes what the worker saw to
`<out_dir>/worker<i>.json`; the chief also saves the weights. Then each
worker reads `model.get_weights()`, the numpy values of `model.weights` and
`count_params()`, and sets the weights of a fresh
one-device GPT (seed 9) with `set_weights`, and records its predictions.

Usage: tp_worker.py OUT_DIR [spmd]
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
  strategy = tfpar.TensorParallelStrategy(mesh, spmd="spmd" in sys.argv[2:])
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(), global_clipnorm=0.5)
  result = tp_common.worker_result(strategy, model, predict_count=20)
  if mesh.cluster.is_chief:
    model.save_weights(os.path.join(out_dir, "weights.weights.h5"))
  result["get_weights"] = [w.tolist() for w in model.get_weights()]
  result["weights_numpy"] = [w.numpy().tolist() for w in model.weights]
  result["count_params"] = model.count_params()
  model.set_weights(tp_common.gpt(seed=9).get_weights())
  px, _ = tp_common.data("gpt", count=20, seed=7)
  result["predict_after_set_weights"] = model.predict(
      px, batch_size=8, verbose=0).tolist()
  with open(os.path.join(out_dir, f"worker{mesh.cluster.task_id}.json"),
            "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
