"""Keras's LoRA and int8-quantized bases under tensor parallelism.

Each case trains a model with LoRA (AdamW, a few steps) under a tfpar
strategy and on one device from the same weights: the LoRA factors end
within 1e-5 of one device's, the frozen base is unchanged, and the bytes
of trainable and of frozen variables are counted on every device from
each variable's per-device components. keras-hub models are built small
(nothing is downloaded): `GemmaCausalLM` with `backbone.enable_lora(4)`
called after the strategy's scope closed (the model already sharded, as
keras-hub users call it after `from_preset`), `LlamaCausalLM` quantized
to int8 then LoRA'd inside the scope (QLoRA-style) at tensor 4, Gemma
in Keras's guide flow (`set_distribution` with keras-hub's layout map); a
stock Dense MLP (float and int8; under ZeRO-3) and a GPT under pipeline
x tensor. Saved weights are one device's Keras file. Other quantization
modes, and LoRA on a split embedding, are refused before any work.
"""

import collections

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import tfpar
import tp_common
from tfpar.common import whole_weights


def _strategy(layout):
  devices = tf.config.list_logical_devices("CPU")
  return tfpar.TensorParallelStrategy(tfpar.Mesh(layout, [
      d.name for d in devices[:layout["data"] * layout["tensor"]]]))


def _causal_lm(family):
  keras.utils.set_random_seed(1)
  shape = dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
               hidden_dim=32, intermediate_dim=64)
  if family == "gemma":  # One key/value head: shared by every device.
    backbone = keras_hub.models.GemmaBackbone(num_key_value_heads=1,
                                              head_dim=8, **shape)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
  backbone = keras_hub.models.LlamaBackbone(num_key_value_heads=2, **shape)
  return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def _set_lora(model, seed=3):
  """Non-zero factors (Keras starts `b` at zero), the same everywhere."""
  rng = np.random.default_rng(seed)
  for weight in model.weights:
    if "lora_kernel" in weight.path:
      weight.assign(0.2 * rng.normal(size=weight.shape).astype("float32"))


def _compile(model):
  optimizer = keras.optimizers.AdamW(0.01)
  optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
  loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
          if hasattr(model, "backbone") else "mse")
  model.compile(optimizer=optimizer, loss=loss)


def _fit(model, data):
  model.fit(*data, batch_size=8, epochs=1, shuffle=False, verbose=0)


def _hub_data():
  x, y = hub_common.data("llama", count=32)
  return x, y


def _bytes(variables):
  """{device: bytes} of `variables` (those a model holds: shards, not
  whole weights), from each variable's per-device components."""
  found = collections.Counter()
  for variable in variables:
    value = variable._value  # pylint: disable=protected-access
    for component in getattr(value, "values", (value,)):
      found[tf.DeviceSpec.from_string(component.device).to_string()] += (
          int(np.prod(component.shape)) * component.dtype.size)
  return found


def _one_device_bytes(variables, split):
  """Bytes of `variables` (one device's model), each divided by the tensor
  size where `split(path)` says the plan splits it."""
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size //
             split(v.path)
             for v in variables)


def _assert_trains_like(model, reference, initial, atol=1e-5):
  """Weights within `atol` of one device's (LoRA factors trained), frozen
  ones unchanged; the weights listed in one device's order. Returns the
  largest LoRA factor difference."""
  got, want = tfpar.logical_weights(model), tfpar.logical_weights(reference)
  assert [w.path for w in model.weights] == [w.path for w in reference.weights]
  assert max(float(np.abs(got[p] - want[p]).max()) for p in want) < atol
  lora = [p for p in want if "lora_kernel" in p]
  assert lora
  for weight in reference.non_trainable_weights:
    np.testing.assert_array_equal(got[weight.path], initial[weight.path],
                                  err_msg=weight.path)
  # AdamW's slots: two per trainable weight, none for the frozen kernels.
  assert len(model.optimizer.variables) == len(reference.optimizer.variables)
  return max(float(np.abs(got[p] - want[p]).max()) for p in lora)


def test_gemma_lora_enabled_after_sharding(tmp_path):
  reference = _causal_lm("gemma")
  reference.backbone.enable_lora(rank=4)
  _set_lora(reference)
  initial = tfpar.logical_weights(reference)
  _compile(reference)
  _fit(reference, _hub_data())

  layout = {"data": 2, "tensor": 2}
  strategy = _strategy(layout)
  with strategy.scope():
    model = _causal_lm("gemma")  # Sharded as the scope closes.
  assert model._tfpar_layouts  # pylint: disable=protected-access
  model.backbone.enable_lora(rank=4)  # As keras-hub users do.
  _set_lora(model)
  with strategy.scope():
    _compile(model)
  _fit(model, _hub_data())
  worst = _assert_trains_like(model, reference, initial)

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
    held = _bytes(variables)
    assert len(held) == 4
    assert set(held.values()) == {_one_device_bytes(one, split)}, name
    print(f"\nMEASURED gemma 2x2 {name} bytes per device "
          f"{max(held.values())} of one device's "
          f"{_one_device_bytes(one, lambda p: 1)}")
  print(f"MEASURED gemma 2x2 LoRA after sharding: weights {worst:.1e}")

  # keras-hub's LoRA files hold whole factors, read and written both ways.
  path = str(tmp_path / "tp.lora.h5")
  model.backbone.save_lora_weights(path)
  one = _causal_lm("gemma")
  one.backbone.load_lora_weights(path)
  got, held = tfpar.logical_weights(one), tfpar.logical_weights(model)
  for name in held:
    if "lora_kernel" in name:
      np.testing.assert_array_equal(got[name], held[name])
  path = str(tmp_path / "one.lora.h5")
  reference.backbone.save_lora_weights(path)
  model.backbone.load_lora_weights(path)
  got, want = tfpar.logical_weights(model), tfpar.logical_weights(reference)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  # Saved weights are one device's file (Keras merges LoRA into kernels).
  model.save_weights(str(tmp_path / "tp.weights.h5"))
  reference.save_weights(str(tmp_path / "one.weights.h5"))
  loaded = []
  for name in ("tp", "one"):
    fresh = _causal_lm("gemma")
    fresh.backbone.enable_lora(rank=4)
    fresh.load_weights(str(tmp_path / f"{name}.weights.h5"))
    loaded.append(tfpar.logical_weights(fresh))
  for name in loaded[1]:
    np.testing.assert_allclose(loaded[0][name], loaded[1][name], atol=1e-6,
                               err_msg=name)


def test_llama_int8_lora_at_tensor_4():
  reference = _causal_lm("llama")
  reference.quantize("int8")
  reference.backbone.enable_lora(rank=4)
  _set_lora(reference)
  initial = tfpar.logical_weights(reference)
  _compile(reference)
  _fit(reference, _hub_data())

  strategy = _strategy({"data": 1, "tensor": 4})
  with strategy.scope():  # Quantized and LoRA'd before it is sharded.
    model = _causal_lm("llama")
    model.quantize("int8")
    model.backbone.enable_lora(rank=4)
    _set_lora(model)
    _compile(model)
  _fit(model, _hub_data())
  worst = _assert_trains_like(model, reference, initial)
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
  frozen = _bytes(model.non_trainable_variables)
  one = _one_device_bytes(reference.non_trainable_variables, lambda p: 1)
  print(f"\nMEASURED llama int8 1x4: weights {worst:.1e}, frozen bytes per "
        f"device {max(frozen.values())} of one device's {one}")


def _mlp(quantize):
  model = tp_common.mlp()
  if quantize:
    model.quantize("int8")
  for layer in model.layers:
    layer.enable_lora(2)
  _set_lora(model)
  _compile(model)
  return model


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int8"])
def test_dense_mlp(quantize, tmp_path):
  data = tp_common.data("mlp", count=32)
  reference = _mlp(quantize)
  initial = tfpar.logical_weights(reference)
  _fit(reference, data)
  strategy = _strategy({"data": 2, "tensor": 2})
  with strategy.scope():
    model = _mlp(quantize)
  _fit(model, data)
  worst = _assert_trains_like(model, reference, initial)
  print(f"\nMEASURED MLP {'int8' if quantize else 'float'} 2x2: weights "
        f"{worst:.1e}")
  axes = {v.path: v.axis for layout in model._tfpar_layouts  # pylint: disable=protected-access
          for v in layout.variables}
  assert axes["mlp/pair1_in/lora_kernel_b"] == 1
  assert axes["mlp/pair1_out/lora_kernel_a"] == 0
  assert axes["mlp/pair1_in/lora_kernel_a"] is None
  if quantize:  # Scales split with column kernels, whole with row ones.
    assert axes["mlp/pair1_in/kernel_scale"] == 0
    assert axes["mlp/pair1_out/kernel_scale"] is None
  # Saved weights are one device's file: Keras's own format (LoRA merged
  # into the kernel, an int8 kernel re-quantized with it).
  model.save_weights(str(tmp_path / "tp.weights.h5"))
  reference.save_weights(str(tmp_path / "one.weights.h5"))
  loaded = []
  for name in ("tp", "one"):
    fresh = _mlp(quantize)
    fresh.load_weights(str(tmp_path / f"{name}.weights.h5"))
    loaded.append(tfpar.logical_weights(fresh))
  for name, want in loaded[1].items():  # int8: one step apart at most.
    np.testing.assert_allclose(loaded[0][name].astype("float64"), want,
                               rtol=1e-5, atol=(
        1 if want.dtype == np.int8 else 1e-6), err_msg=name)


def test_gpt_lora_under_pipeline_stages():
  def build():
    model = tp_common.gpt(blocks=2)
    for layer in keras_layers(model):
      if layer.name != "lm_head":
        layer.enable_lora(2)
    _set_lora(model)
    tp_common.compile_model(model)
    return model
  data = tp_common.data("gpt", count=32)
  reference = build()
  initial = tfpar.logical_weights(reference)
  _fit(reference, data)
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2)
  with strategy.scope():
    model = build()
  _fit(model, data)
  worst = _assert_trains_like(model, reference, initial)
  print(f"\nMEASURED GPT pipeline 2 x tensor 2: weights {worst:.1e}")
  with pytest.raises(ValueError, match=(
      r"Cannot enable LoRA on layer 'lm_head' .*rank=2.*pipeline stages")):
    model.get_layer("lm_head").enable_lora(2)


def keras_layers(model):
  return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
          if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)]


def test_mlp_lora_under_zero_3():
  data = tp_common.data("mlp", count=32)
  reference = _mlp(False)
  initial = tfpar.logical_weights(reference)
  _fit(reference, data)
  with _strategy({"data": 2, "tensor": 2}).scope():
    model = _mlp(False)
  model.fit(*data, batch_size=8, epochs=1, shuffle=False, verbose=0,
            callbacks=[tfpar.ZeRO(stage=3)])
  worst = _assert_trains_like(model, reference, initial)
  print(f"\nMEASURED MLP ZeRO-3 2x2: weights {worst:.1e}")


def test_refusals_name_the_setting():
  strategy = _strategy({"data": 2, "tensor": 2})
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
    with _strategy({"data": 2, "tensor": 2}).scope():
      tp_common.mlp().quantize("int4")


def test_gemma_lora_in_the_keras_guide_flow():
  """Keras's "Distributed tuning with Gemma" on TensorFlow: keras-hub's
  layout map set as the distribution, then plain Keras code."""
  def flow():
    model = _causal_lm("gemma")
    model.backbone.enable_lora(rank=4)
    _set_lora(model)
    _compile(model)
    _fit(model, _hub_data())
    return tfpar.logical_weights(model)
  expected = flow()
  mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
  try:
    with pytest.warns(UserWarning, match="kept whole over the batch axis"):
      keras.distribution.set_distribution(keras.distribution.ModelParallel(
          layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
          batch_dim_name="batch"))
    assert isinstance(tf.distribute.get_strategy(),
                      tfpar.TensorParallelStrategy)
    got = flow()
  finally:
    keras.distribution.set_distribution(None)
  worst = max(float(np.abs(got[p] - expected[p]).max()) for p in expected)
  assert worst < 1e-5, worst
  print(f"\nMEASURED gemma guide flow (set_distribution 2x2): weights "
        f"{worst:.1e}")
