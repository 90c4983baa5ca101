"""Keras's mixed precision policies under every tfpar layout: the small
GPT of the tensor-parallel tests (embeddings, attention, GELU MLP,
LayerNorms) trained under `mixed_float16` (with Keras's dynamic loss
scaling) and `mixed_bfloat16`, against one device under the same policy,
within the spread of stock `MirroredStrategy` vs one device measured side
by side. Tensor parallelism communicates activations in the compute dtype:
half the bytes of float32, counted from the log of the same step."""

import functools

import keras
import pytest
import tensorflow as tf

import precision_common
import stock_strategies
import tfpar
import tp_common

POLICIES = ["mixed_float16", "mixed_bfloat16"]


def _data2():
  return tfpar.Mesh({"data": 2}, devices=tfpar.Mesh().devices[:2])


# The pipeline under 1F1B only: the schedule orders the same micro-batch
# steps (tfpar/pipeline/steps.py scales and casts for both), and GPipe
# measured the same differences to the last digit in both policies
# (docs/precision_and_accumulation.md); test_pipeline proves each
# schedule equal to one device in float32.
LAYOUTS = {
    "data 2": lambda: (tfpar.DataParallelStrategy(_data2()), []),
    "data 2 x tensor 2": lambda: (tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})), []),
    "data 2 x tensor 2, sequence parallel": lambda: (
        tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2, "tensor": 2}),
                                     sequence_parallel=True), []),
    "data 2 x pipeline 2, 1F1B": lambda: (tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2), []),
    "pipeline 2 x tensor 2": lambda: (tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2), []),
    # Every stage with offload here; without offload in test_mixed_precision.
    **{f"ZeRO-{stage}, offload": functools.partial(
        lambda stage: (tfpar.DataParallelStrategy(_data2()),
                       [tfpar.ZeRO(stage=stage, offload="cpu")]), stage)
       for stage in (1, 2, 3)},
    "data 2 x tensor 2, ZeRO-2": lambda: (tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})), [tfpar.ZeRO(stage=2)]),
}


def _train(policy, layout=None):
  """(step losses, whole weights, communication log) of 12 steps."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    if layout is None:
      strategy, callbacks = None, []
    elif layout == "mirrored":
      strategy = stock_strategies.mirrored(tfpar.Mesh().devices[:2])
      callbacks = []
    else:
      strategy, callbacks = LAYOUTS[layout]()
    with strategy.scope() if strategy else tf.init_scope():
      model = tp_common.compile_model(tp_common.gpt())
    x, y = tp_common.data("gpt")
    with tfpar.CommunicationLog() as log:
      losses = tp_common.step_losses(model, x, y, epochs=1,
                                     callbacks=callbacks)
    return losses, model.get_weights(), log
  finally:
    keras.mixed_precision.set_global_policy("float32")


@functools.cache
def _spread(policy):
  """(reference run, loss spread, weight spread) of stock MirroredStrategy
  on 2 CPUs against one device."""
  reference = _train(policy)
  return (reference,) + _difference(_train(policy, "mirrored"), reference)


def _difference(result, reference):
  return precision_common.differences(result[0], result[1], reference[0],
                                      reference[1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_trains_like_one_device(policy, layout):
  reference, spread_loss, spread_weights, _ = _spread(policy)
  result = _train(policy, layout)
  measured = _difference(result, reference)
  print(f"{policy} {layout}: losses {measured[0]:.1e} weights "
        f"{measured[1]:.1e} first loss {measured[2]:.1e}; mirrored "
        f"{spread_loss:.1e} / {spread_weights:.1e}")
  # Sequence parallelism's extra gap is in the attention key biases, whose
  # gradient is 0 in exact arithmetic (docs/precision_and_accumulation.md).
  precision_common.assert_within_spread(
      policy, "tensor" in layout, measured, (spread_loss, spread_weights),
      first_loss=reference[0][0])
  if "tensor" in layout and "ZeRO" not in layout:
    # Activations (and their gradients) cross devices in the compute
    # dtype, the embeddings' token ids stay int32.
    mixed, single = _bytes(result[2]), _float32_bytes(layout)
    assert mixed.keys() == single.keys()
    for key, nbytes in single.items():
      token_ids = key[0] in ("tokens", "positions") and key[1:] == (
          "broadcast", "forward")
      assert mixed[key] == (nbytes if token_ids else nbytes // 2), key


@functools.cache
def _float32_bytes(layout):
  return _bytes(_train("float32", layout)[2])


def _bytes(log):
  """Bytes of one step's records per (layer, kind, phase)."""
  totals = {}
  for record in log.step_records():
    key = (record.layer, record.kind, record.phase)
    totals[key] = totals.get(key, 0) + record.bytes
  return totals
