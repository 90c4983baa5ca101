"""Worker script for the cross-worker pipeline test, run by `tfpar launch`.

Builds a pipeline whose 4 stages span the 2 workers (data 1): the chief
trains `pp_common`'s model and writes its results to `<out_dir>/chief.json`;
the other worker serves its stages and exits when the chief is done.

Usage: pp_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pp_common  # pylint: disable=g-import-not-at-top
import tfpar


def main():
  mesh = tfpar.Mesh.from_cluster_resolver(data=1, pipeline=-1)
  strategy = tfpar.PipelineParallelStrategy(mesh, num_microbatches=4)
  history, evaluation, prediction, weights, model = pp_common.train(strategy)
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  devices = {stage.index: sorted({c.device for v in stage.variables
                                  for c in v.value.values})
             for stage in plan.stages}
  with open(os.path.join(sys.argv[1], "chief.json"), "w") as f:
    json.dump({"history": history, "evaluate": evaluation,
               "predict": prediction.tolist(),
               "weights": [w.tolist() for w in weights],
               "stage_devices": devices}, f)


if __name__ == "__main__":
  main()
