"""Keras's LoRA and int8 bases of stock Dense layers under tensor
parallelism, pipeline x tensor stages and ZeRO-3, and what is refused.

A Megatron MLP of stock Dense layers (float, and `model.quantize("int8")`
then LoRA) under data 2 x tensor 2, a GPT with LoRA on every projection
under pipeline 2 x tensor 2, and the MLP under ZeRO-3 train like one
device (AdamW, 4 steps, within 1e-5); the column layers' LoRA `b` and
int8 scales are split with their outputs, the row layers' `a` with their
inputs; saved weights are one device's Keras file. Quantizing a sharded
model, other quantization modes, LoRA on a split embedding and
`enable_lora` once pipeline stages are cut are ValueErrors.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lora_common
import tfpar
import tp_common


def _mlp(quantize):
  model = tp_common.mlp()
  if quantize:
    model.quantize("int8")
  for layer in model.layers:
    layer.enable_lora(2)
  lora_common.set_lora(model)
  lora_common.compile_model(model)
  return model


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int8"])
def test_dense_mlp(quantize, tmp_path):
  data = tp_common.data("mlp", count=32)
  reference = _mlp(quantize)
  initial = tfpar.logical_weights(reference)
  lora_common.fit(reference, data)
  strategy = lora_common.strategy({"data": 2, "tensor": 2})
  with strategy.scope():
    model = _mlp(quantize)
  lora_common.fit(model, data)
  worst = lora_common.assert_trains_like(model, reference, initial)
  held = lora_common.report(f"MLP {'int8' if quantize else 'float'} 2x2",
                            model, reference, worst)
  if not quantize:  # Every frozen kernel is split: half on each device.
    assert held["frozen"][0] * 2 == held["frozen"][1]
  axes = {v.path: v.axis for layout in model._tfpar_layouts  # pylint: disable=protected-access
          for v in layout.variables}
  assert axes["mlp/pair1_in/lora_kernel_b"] == 1
  assert axes["mlp/pair1_out/lora_kernel_a"] == 0
  assert axes["mlp/pair1_in/lora_kernel_a"] is None
  if quantize:  # Scales split with column kernels, whole with row ones.
    assert axes["mlp/pair1_in/kernel_scale"] == 0
    assert axes["mlp/pair1_out/kernel_scale"] is None
  lora_common.assert_saved_like(model, reference, lambda: _mlp(quantize),
                                tmp_path)


def _gpt_with_lora(blocks, skip=()):
  """tp_common's GPT, LoRA rank 2 on its projections but `skip`, compiled."""
  model = tp_common.gpt(blocks=blocks)
  for layer in _projections(model):
    if layer.name not in skip:
      layer.enable_lora(2)
  lora_common.set_lora(model)
  tp_common.compile_model(model)
  return model


def test_gpt_lora_under_pipeline_stages():
  """3D: LoRA on block 0 enabled before the model is cut, on block 1 (the
  second stage) after, as keras-hub users call enable_lora after building:
  the late factors are laid out on their stage's devices."""
  data = tp_common.data("gpt", count=32)
  reference = _gpt_with_lora(blocks=2, skip=("lm_head",))
  initial = tfpar.logical_weights(reference)
  lora_common.fit(reference, data)
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2)
  with strategy.scope():
    model = tp_common.gpt(blocks=2)
    late = [layer for top in model.layers if top.name.startswith("block1_")
            for layer in _projections(top, include_self=True)]
    for layer in _projections(model):
      if layer.name != "lm_head" and layer not in late:
        layer.enable_lora(2)
  assert model._tfpar_stage_plan  # pylint: disable=protected-access
  for layer in late:
    layer.enable_lora(2)
  lora_common.set_lora(model)
  with strategy.scope():
    tp_common.compile_model(model)
  lora_common.fit(model, data)
  worst = lora_common.assert_trains_like(model, reference, initial)
  # The factors enabled late live on the second stage's devices only.
  late_factors = [v for v in model.trainable_variables
                  if "lora_kernel" in v.path and v.path.startswith("block1_")]
  assert len(late_factors) == 2 * len(late)
  assert sorted(device.rsplit("/", 1)[-1] for device in
                lora_common.device_bytes(late_factors)) == [
                    "device:CPU:2", "device:CPU:3"]
  lora_common.report("GPT pipeline 2 x tensor 2", model, reference, worst)


def _projections(model, include_self=False):
  return [layer for layer in model._flatten_layers(include_self=include_self)  # pylint: disable=protected-access
          if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)]


def test_mlp_lora_under_zero_3(tmp_path):
  data = tp_common.data("mlp", count=32)
  reference = _mlp(False)
  initial = tfpar.logical_weights(reference)
  lora_common.fit(reference, data)
  with lora_common.strategy({"data": 2, "tensor": 2}).scope():
    model = _mlp(False)
  model.fit(*data, batch_size=8, epochs=1, shuffle=False, verbose=0,
            callbacks=[tfpar.ZeRO(stage=3)])
  worst = lora_common.assert_trains_like(model, reference, initial)
  lora_common.report("MLP ZeRO-3 2x2", model, reference, worst)
  lora_common.assert_saved_like(model, reference, lambda: _mlp(False),
                                tmp_path)


def test_gpt_lora_with_sequence_parallelism():
  """MultiHeadAttention and the MLP with LoRA, the norms and residuals on
  sequence slices."""
  build = lambda: _gpt_with_lora(blocks=1)
  data = tp_common.data("gpt", count=32)
  reference = build()
  initial = tfpar.logical_weights(reference)
  lora_common.fit(reference, data)
  devices = tf.config.list_logical_devices("CPU")
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}, [d.name for d in devices]),
      sequence_parallel=True)
  with strategy.scope():
    model = build()
  lora_common.fit(model, data)
  worst = lora_common.assert_trains_like(model, reference, initial)
  lora_common.report("GPT 2x2, sequence parallel", model, reference,
                     worst)


def test_refusals_name_the_setting():
  strategy = lora_common.strategy({"data": 2, "tensor": 2})
  with strategy.scope():
    model = tp_common.mlp()
  with pytest.raises(ValueError, match=(
      r"Cannot quantize layer 'pair1_in' \(mode='int8'\) .*already sharded")):
    model.quantize("int8")
  inputs = keras.Input((4,), dtype="int32")
  table = keras.layers.Embedding(64, 8, name="table")
  outputs = keras.layers.Dense(64, name="head")(table(inputs))
  plain = keras.Model(inputs, outputs)
  table.enable_lora(2)
  with pytest.raises(ValueError, match=(
      r"Layer 'table' \(Embedding\) has LoRA enabled")):
    tfpar.ShardingPlan().resolve(plain, 2)
  with pytest.raises(ValueError, match=r"quantization_mode='int4'"):
    with lora_common.strategy({"data": 2, "tensor": 2}).scope():
      tp_common.mlp().quantize("int4")


def test_describe_lists_factors_of_lora_enabled_after_a_fit():
  # enable_lora after the model is sharded and trained: describe shows the
  # factors as they are split (it listed them replicated).
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))
    model.compile(optimizer="sgd", loss="mse")
  x = np.ones((8, 8), "float32")
  model.fit(x, x, batch_size=8, verbose=0)
  model.get_layer("up").enable_lora(2)
  model.get_layer("down").enable_lora(2)
  rows = {line.split()[0]: line for line in strategy.describe(
      model, print_fn=None).splitlines() if "lora" in line.split()[0]}
  assert "ColumnParallel axis 1  (2, 8)" in rows["up/lora_kernel_b"]
  assert "RowParallel axis 0     (8, 2)" in rows["down/lora_kernel_a"]
  assert "Replicate" in rows["up/lora_kernel_a"]
  assert "Replicate" in rows["down/lora_kernel_b"]
  model.fit(x, x, batch_size=8, verbose=0)  # Trains with them.
