"""Worker script for the multi-worker tensor-parallel test.

Trains tp_common's GPT (global_clipnorm 0.5) under TensorParallelStrategy
(tensor 2 inside each worker, data across workers; with `spmd`, every
device tracing the step) and writes what the worker saw to
`<out_dir>/worker<i>.json`; the chief also saves the weights. Then each
worker reads `model.get_weights()`, the numpy values of `model.weights` and
`count_params()`, and sets the weights of a fresh
one-device GPT (seed 9) with `set_weights`, and records its predictions.

With `zero<stage>` it fits under `tfpar.ZeRO(stage=<stage>)` (each tensor
column's optimizer state, and at stage 3 its weights, sliced over the data
replicas, i.e. across the workers) and every worker takes part in saving
(`tfpar.save_weights`), which gathers the whole weights and optimizer
state.

Usage: tp_worker.py OUT_DIR [spmd] [zero1|zero2|zero3]
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
  zero = next((int(a[len("zero"):]) for a in sys.argv[2:]
               if a.startswith("zero")), None)
  result = tp_common.worker_result(
      strategy, model, predict_count=20,
      callbacks=[tfpar.ZeRO(stage=zero)] if zero else ())
  path = os.path.join(out_dir, "weights.weights.h5")
  if zero:  # Every worker gathers its slices; the chief writes.
    tfpar.save_weights(model, path)
  elif mesh.cluster.is_chief:
    model.save_weights(path)
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
