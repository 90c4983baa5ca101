"""Worker script for the 3D (data x pipeline x tensor) tests.

Trains tp_common's GPT under PipelineParallelStrategy with tensor-parallel
stages, optionally with tfpar.ZeRO, once per case, and writes what each
case saw to `OUT_DIR/<name>_worker<task>.json`. Its batches' size is
unknown when the step is traced (`dataset.batch(n)`, as across workers),
which keeps the loss's shape `Assert`s in the step: SPMD stages deadlocked
on them until each trace's side effects were ordered on its own
(`tfpar/_compat/side_effects.py`). Alone it makes its own
virtual CPUs (as many as the largest case needs; each case takes the first
ones), so several cases pay TensorFlow's start once; under `tfpar launch`
the mesh spans the TF_CONFIG workers (data across them).

Usage: td_worker.py OUT_DIR CASE [CASE ...]
  CASE: NAME,DATA,PIPELINE,TENSOR,SCHEDULE,ZERO_STAGE
    (ZERO_STAGE 0: no ZeRO)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar  # pylint: disable=g-import-not-at-top
from tfpar import memory
from tfpar.common import whole_weights
import tp_common

MICROBATCHES = 2


def _parse(case):
  name, data, pipeline, tensor, schedule, zero_stage = case.split(",")
  return (name, int(data), int(pipeline), int(tensor), schedule,
          int(zero_stage))


def _run(out_dir, name, data, pipeline, tensor, schedule, zero_stage):
  if "TF_CONFIG" in os.environ:
    mesh = tfpar.Mesh.from_cluster_resolver(data=data, pipeline=pipeline,
                                            tensor=tensor)
    worker = mesh.cluster.task_id
  else:
    mesh = tfpar.Mesh({"data": data, "pipeline": pipeline, "tensor": tensor},
                      devices=tfpar.Mesh().devices[:data * pipeline * tensor])
    worker = 0
  strategy = tfpar.PipelineParallelStrategy(
      mesh, num_microbatches=MICROBATCHES, schedule=schedule)
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(), global_clipnorm=0.5)
  callbacks = [tfpar.ZeRO(stage=zero_stage)] if zero_stage else []
  result = tp_common.worker_result(strategy, model, predict_count=16,
                                   callbacks=callbacks, static_batch=False)
  result.update({
      # The variables held (shards), not model.weights' whole weights.
      "devices": {v.path: [c.device for c in memory.components(v)]
                  for v in whole_weights.held(model)},
      # The weights split over the tensor axis (the others are replicated:
      # on every device of a stage's tensor group under SPMD).
      "split": sorted(v.path for layout in model._tfpar_layouts  # pylint: disable=protected-access
                      for v in layout.variables if v.axis is not None),
      "optimizer_bytes": memory.memory_report(model).optimizer,
      "parameter_bytes": memory.memory_report(model).parameters,
  })
  with open(os.path.join(out_dir, f"{name}_worker{worker}.json"), "w") as f:
    json.dump(result, f)


def main():
  out_dir, cases = sys.argv[1], [_parse(case) for case in sys.argv[2:]]
  if "TF_CONFIG" not in os.environ:
    tfpar.configure_virtual_cpus(max(d * p * t for _, d, p, t, *_ in cases))
  for case in cases:
    _run(out_dir, *case)


if __name__ == "__main__":
  main()
