"""Worker script for 3D (data 2 x pipeline 2 x tensor 2) under Keras's mixed
policies and with gradient accumulation, on 8 virtual CPUs of its own.

Trains tp_common's GPT (12 steps, Adam, as tests/test_precision_matrix.py)
(3D with ZeRO-2 under mixed_bfloat16; with TFPAR_TEST_FULL=1 also 3D under
mixed_float16) and writes,
per case, the largest difference from one device in the step
losses and in the weights, next to the spread of stock MirroredStrategy on
2 CPUs against one device under the same policy, measured in this same
process; and 3D with ZeRO-2 and gradient accumulation in float32 against
one device accumulating as well.

Usage: td_precision_worker.py OUT_JSON
"""

import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpar  # pylint: disable=g-import-not-at-top

tfpar.configure_virtual_cpus(8)

import keras  # pylint: disable=g-import-not-at-top

import precision_common  # pylint: disable=g-import-not-at-top
import stock_strategies  # pylint: disable=g-import-not-at-top
import suite_scope  # pylint: disable=g-import-not-at-top
import tp_common  # pylint: disable=g-import-not-at-top

STEPS = 12
THREE_D_ZERO_STAGE = {"mixed_float16": 0, "mixed_bfloat16": 2}
LAYOUT_NAMES = {0: "3d", 2: "3d ZeRO-2"}


def _three_d():
  return tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": 2, "pipeline": 2, "tensor": 2}),
      num_microbatches=2)


def _train(policy, strategy, zero_stage=0, accumulation=None):
  """(step losses, whole weights by path) of `STEPS` steps."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = tp_common.compile_model(
          tp_common.gpt(), gradient_accumulation_steps=accumulation)
    x, y = tp_common.data("gpt", count=tp_common.BATCH * STEPS)
    callbacks = [tfpar.ZeRO(stage=zero_stage)] if zero_stage else []
    losses = tp_common.step_losses(model, x, y, epochs=1,
                                   callbacks=callbacks)
    return losses, tfpar.logical_weights(model)
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _difference(result, reference):
  """precision_common.differences of two `_train` results."""
  assert sorted(result[1]) == sorted(reference[1])
  paths = sorted(reference[1])
  return precision_common.differences(
      result[0], [result[1][path] for path in paths], reference[0],
      [reference[1][path] for path in paths])


def main():
  out = {}
  # mixed_float16 (loss scaling) under 3D only with TFPAR_TEST_FULL=1: the
  # precision matrix runs pipeline x tensor under it, and this file's
  # mixed_bfloat16 case runs 3D itself.
  for policy in suite_scope.cases(["mixed_bfloat16"], ["mixed_float16"]):
    reference = _timed(_train, policy, None)
    mirrored = stock_strategies.mirrored(tfpar.Mesh().devices[:2])
    out[policy] = {
        "first loss": float(reference[0][0]),
        "mirrored": _difference(_timed(_train, policy, mirrored), reference),
    }
    # One 3D layout per policy, for time (each takes 8 devices): both
    # layouts meet a loss-scaled and an unscaled policy between them, and
    # the precision matrix runs pipeline x tensor and tensor + ZeRO-2 under
    # both policies.
    stage = THREE_D_ZERO_STAGE[policy]
    out[policy][LAYOUT_NAMES[stage]] = _difference(
        _timed(_train, policy, _three_d(), stage), reference)
  # Accumulation in float32, where one device with the same k is exact.
  reference = _timed(_train, "float32", None, accumulation=2)
  out["float32, accumulation 2"] = {
      "3d ZeRO-2": _difference(
          _timed(_train, "float32", _three_d(), 2, 2), reference),
      # How far accumulation moves training: the comparison can fail.
      "one device without accumulation": _difference(
          _timed(_train, "float32", None), reference),
  }
  with open(sys.argv[1], "w") as f:
    json.dump(out, f)


def _timed(function, *args, **kwargs):
  start = time.time()
  result = function(*args, **kwargs)
  print(f"{args[0]} {type(args[1]).__name__} {args[2:]} {kwargs}: "
        f"{time.time() - start:.0f} s", file=sys.stderr, flush=True)
  return result


if __name__ == "__main__":
  main()
