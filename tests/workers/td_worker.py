"""Worker script for the 3D (data x pipeline x tensor) tests.

Trains tp_common's GPT under PipelineParallelStrategy with tensor-parallel
stages, optionally with tfpar.ZeRO, and writes what it saw to
`OUT_DIR/<name>.json`. Alone it makes its own virtual CPUs; under
`tfpar launch` the mesh spans the TF_CONFIG workers (data across them).

Usage: td_worker.py OUT_DIR NAME DATA PIPELINE TENSOR SCHEDULE ZERO_STAGE
  (ZERO_STAGE 0: no ZeRO)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar  # pylint: disable=g-import-not-at-top
from tfpar import memory
import tp_common

MICROBATCHES = 2


def main():
  out_dir, name = sys.argv[1], sys.argv[2]
  data, pipeline, tensor = (int(a) for a in sys.argv[3:6])
  schedule, zero_stage = sys.argv[6], int(sys.argv[7])
  if "TF_CONFIG" in os.environ:
    mesh = tfpar.Mesh.from_cluster_resolver(data=data, pipeline=pipeline,
                                            tensor=tensor)
    worker = mesh.cluster.task_id
  else:
    tfpar.configure_virtual_cpus(data * pipeline * tensor)
    mesh = tfpar.Mesh({"data": data, "pipeline": pipeline, "tensor": tensor})
    worker = 0
  strategy = tfpar.PipelineParallelStrategy(
      mesh, num_microbatches=MICROBATCHES, schedule=schedule)
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(), global_clipnorm=0.5)
  callbacks = [tfpar.ZeRO(stage=zero_stage)] if zero_stage else []
  result = tp_common.worker_result(strategy, model, predict_count=16,
                                   callbacks=callbacks)
  result.update({
      "devices": {v.path: [c.device for c in memory.components(v)]
                  for v in model.weights},
      "optimizer_bytes": memory.memory_report(model).optimizer,
      "parameter_bytes": memory.memory_report(model).parameters,
  })
  with open(os.path.join(out_dir, f"{name}_worker{worker}.json"), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
