"""Keras's LoRA and int8-quantized bases under tensor parallelism.

Each case trains a keras-hub model with LoRA (AdamW, 4 steps) under a
tfpar strategy and on one device from the same weights: the LoRA factors
end within 1e-5 of one device's, the frozen base is unchanged, and the
bytes of trainable and of frozen variables are counted on every device
from each variable's per-device components. The models are built small
(nothing is downloaded): `GemmaCausalLM` with `backbone.enable_lora(4)`
called after the strategy's scope closed (the model already sharded, as
keras-hub users call it after `from_preset`), with keras-hub's LoRA files
and saved weights read and written as one device's; `LlamaCausalLM`
quantized to int8 then LoRA'd inside the scope (QLoRA-style) at tensor
4; Gemma in Keras's guide flow (`set_distribution` with keras-hub's
layout map). Stock layers: `test_tensor_lora_layers.py`.
"""

import functools
import re

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import lora_common
import tfpar
import variable_accounting
from tfpar.common import whole_weights


@functools.lru_cache(maxsize=None)
def _gemma_lora_reference():
  """(model, initial logical weights): Gemma with LoRA trained on one
  device, shared by the tests that compare against it (trained once)."""
  reference = lora_common.causal_lm("gemma")
  reference.backbone.enable_lora(rank=4)
  lora_common.set_lora(reference)
  initial = tfpar.logical_weights(reference)
  lora_common.compile_model(reference)
  lora_common.fit(reference, lora_common.hub_data())
  return reference, initial


def test_gemma_lora_enabled_after_sharding(tmp_path):
  reference, initial = _gemma_lora_reference()

  layout = {"data": 2, "tensor": 2}
  strategy = lora_common.strategy(layout)
  with strategy.scope():
    model = lora_common.causal_lm("gemma")  # Sharded as the scope closes.
  assert model._tfpar_layouts  # pylint: disable=protected-access
  model.backbone.enable_lora(rank=4)  # As keras-hub users do.
  lora_common.set_lora(model)
  with strategy.scope():
    lora_common.compile_model(model)
  lora_common.fit(model, lora_common.hub_data())
  worst = lora_common.assert_trains_like(model, reference, initial)

  # Split: the query heads (their LoRA `a` holds them), the MLP, the
  # vocabulary; whole: norms, the one key/value head, query LoRA `b`.
  def split(path):
    whole = ("norm" in path or "/key/" in path or "/value/" in path or
             path.endswith("query/lora_kernel_b"))
    return 1 if whole else 2
  for name, variables, one in (
      ("trainable", model.trainable_variables,
       reference.trainable_variables),
      ("frozen", model.non_trainable_variables,
       reference.non_trainable_variables)):
    held = lora_common.device_bytes(variables)
    assert len(held) == 4
    expected = lora_common.one_device_bytes(one, split)
    assert set(held.values()) == {expected}, name
  lora_common.report("Gemma 2x2, LoRA after sharding", model, reference,
                     worst)

  # keras-hub's LoRA files hold whole factors, read and written both ways.
  path = str(tmp_path / "tp.lora.h5")
  model.backbone.save_lora_weights(path)
  one = lora_common.causal_lm("gemma")
  one.backbone.load_lora_weights(path)
  got, held = tfpar.logical_weights(one), tfpar.logical_weights(model)
  for name in held:
    if "lora_kernel" in name:
      np.testing.assert_array_equal(got[name], held[name])
  path = str(tmp_path / "one.lora.h5")
  reference.backbone.save_lora_weights(path)
  with strategy.scope():
    loading = lora_common.causal_lm("gemma")
  loading.backbone.load_lora_weights(path)  # Enables LoRA, sharded.
  got, want = tfpar.logical_weights(loading), tfpar.logical_weights(reference)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  # Saved weights are one device's file (Keras merges LoRA into kernels).
  def fresh():
    one = lora_common.causal_lm("gemma")
    one.backbone.enable_lora(rank=4)
    return one
  lora_common.assert_saved_like(model, reference, fresh, tmp_path)


def test_llama_int8_lora_at_tensor_4():
  reference = lora_common.causal_lm("llama")
  reference.quantize("int8")
  reference.backbone.enable_lora(rank=4)
  lora_common.set_lora(reference)
  initial = tfpar.logical_weights(reference)
  lora_common.compile_model(reference)
  lora_common.fit(reference, lora_common.hub_data())

  strategy = lora_common.strategy({"data": 1, "tensor": 4})
  accounting = variable_accounting.VariableAccounting()
  with accounting.counting(), strategy.scope():
    model = lora_common.causal_lm("llama")  # Created spread.
    built = max(accounting.now().values())
    model.quantize("int8")  # Its int8 kernels too: no device holds them all.
    model.backbone.enable_lora(rank=4)
    lora_common.set_lora(model)
    lora_common.compile_model(model)
  int8 = lora_common.one_device_bytes(reference.non_trainable_variables,
                                      lambda path: 1)
  assert max(accounting.peak.values()) <= built + int8 // 4, (
      accounting.peak, built, int8)
  lora_common.fit(model, lora_common.hub_data())
  worst = lora_common.assert_trains_like(model, reference, initial)
  shards = {v.path: v for v in whole_weights.held(model)}
  # int8 kernels split as the float ones: query heads, MLP in / out, the
  # vocabulary (untied output table too), each with its scale.
  for path, shape in (
      ("transformer_layer_0/self_attention/query/kernel", (32, 1, 8)),
      ("transformer_layer_0/self_attention/query/kernel_scale",
       (1, 1, 1, 8)),
      ("transformer_layer_0/self_attention/attention_output/kernel",
       (1, 8, 32)),
      ("transformer_layer_0/feedforward_output_dense/kernel", (16, 32)),
      ("token_embedding/embeddings", (16, 32)),
      ("token_embedding/reverse_embeddings", (32, 16)),
      ("token_embedding/reverse_embeddings_scale", (16,))):
    assert tuple(shards[path].shape) == shape, path
  assert shards["token_embedding/embeddings"].dtype == "int8"
  # 2 key/value heads on 4 devices: their projections and LoRA whole.
  assert tuple(shards["transformer_layer_0/self_attention/value/"
                      "lora_kernel_a"].shape) == (32, 2, 4)
  lora_common.report("Llama int8 1x4", model, reference, worst)


def test_gemma_lora_in_the_keras_guide_flow():
  """Keras's "Distributed tuning with Gemma" on TensorFlow: keras-hub's
  layout map set as the distribution, then plain Keras code."""
  def flow():
    model = lora_common.causal_lm("gemma")
    model.backbone.enable_lora(rank=4)
    lora_common.set_lora(model)
    lora_common.compile_model(model)
    lora_common.fit(model, lora_common.hub_data())
    return tfpar.logical_weights(model)
  # One device's run of the same flow: the shared reference.
  expected = tfpar.logical_weights(_gemma_lora_reference()[0])
  mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
  try:
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
        batch_dim_name="batch"))
    # The map spreads weights over the batch axis too: the strategy's ZeRO-3.
    strategy = tf.distribute.get_strategy()
    assert isinstance(strategy, tfpar.TensorParallelStrategy)
    assert strategy.extended.zero.stage == 3
    got = flow()
  finally:
    keras.distribution.set_distribution(None)
  worst = max(float(np.abs(got[p] - expected[p]).max()) for p in expected)
  assert worst < 1e-5, worst
  print(f"\nMEASURED gemma guide flow (set_distribution 2x2): weights "
        f"{worst:.1e}")


def test_mixtral_lora_under_expert_x_tensor():
  """LoRA on the attention of a mixture-of-experts model whose experts are
  split by expert parallelism and everything else by the tensor plan: the
  factors train as on one device and split with their kernels."""
  def mixtral():
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
        num_experts=4, top_k=2, router_jitter_noise=0.0)
    model = keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)
    model.backbone.enable_lora(rank=4)
    lora_common.set_lora(model)
    return model

  reference = mixtral()
  initial = tfpar.logical_weights(reference)
  lora_common.compile_model(reference)
  lora_common.fit(reference, lora_common.hub_data())
  strategy = tfpar.ExpertParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}), expert=2)
  with strategy.scope():
    model = mixtral()
    lora_common.compile_model(model)
  lora_common.fit(model, lora_common.hub_data())
  worst = lora_common.assert_trains_like(
      model, reference, initial, same_path=lambda path: re.sub(
          r"sparse_moe_block(_\d+)?/", "sparse_moe_block/", path))
  found = lora_common.report("Mixtral expert x tensor 2x2, LoRA", model,
                             reference, worst)
  # Attention, experts and vocabulary split (by tensor or expert): every
  # device holds well under 3/4 of one device's trainable and frozen bytes.
  for name, (fullest, one) in found.items():
    assert fullest < 0.75 * one, (name, fullest, one)
