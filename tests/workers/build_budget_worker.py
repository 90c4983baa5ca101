"""Worker for tests/test_build_budget.py: builds and trains a GPT whose
weights are more than 4x a per-device budget on 8 virtual CPUs (this
process's own) under each layout, counting every variable per device as it
is created (`variable_accounting`, independent of tfpar); trains the same
model once on one device and writes every layout's comparison to `OUT`.

Usage: build_budget_worker.py OUT LAYOUT...   (LAYOUT: tensor8 | zero3_data8)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar  # pylint: disable=g-import-not-at-top

tfpar.configure_virtual_cpus(8)

import precision_common  # pylint: disable=g-import-not-at-top
import test_weights_created_in_place as weights_created_in_place  # pylint: disable=g-import-not-at-top
import tp_common  # pylint: disable=g-import-not-at-top
from variable_accounting import VariableAccounting  # pylint: disable=g-import-not-at-top

WIDTH, BLOCKS, STEPS = 64, 2, 2


def gpt():
  """test_weights_created_in_place's GPT, 2 blocks of width 64."""
  return weights_created_in_place.gpt(seed=11, width=WIDTH, blocks=BLOCKS,
                                      heads=8)


def train(model):
  x, y = tp_common.data("gpt", count=tp_common.BATCH * STEPS)
  return tp_common.step_losses(model, x, y, epochs=1)


def strategy_for(layout):
  if layout == "tensor8":
    return tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 1, "tensor": 8}))
  return tfpar.DataParallelStrategy(tfpar.Mesh({"data": 8}),
                                    zero=tfpar.ZeRO(stage=3))


def compare(layout, reference, reference_losses):
  """Builds and trains under `layout`, counted: its peaks and differences
  from the one-device `reference`."""
  accounting = VariableAccounting()
  with accounting.counting():
    with strategy_for(layout).scope():
      model = gpt()
    losses = train(model)
  weights = model.get_weights()
  arrays = [len(weights), len(reference.get_weights())]
  loss_diff, weight_diff = precision_common.differences(
      losses, weights, reference_losses, reference.get_weights())[:2]
  return {
      "peak": dict(accounting.peak),
      "largest": accounting.largest,
      "loss_diff": loss_diff,
      "weight_diff": weight_diff,
      "arrays": arrays,
  }


def main():
  out, layouts = sys.argv[1], sys.argv[2:]
  reference = gpt()
  reference_losses = train(reference)
  result = {
      "weight_bytes": sum(w.nbytes for w in reference.get_weights()),
      "layouts": {layout: compare(layout, reference, reference_losses)
                  for layout in layouts},
  }
  with open(out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
