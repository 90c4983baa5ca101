"""Keras's LoRA and int8-quantized bases under tensor parallelism.

Each case trains a model with LoRA (AdamW, a few steps) under a tfpar
strategy and on one device from the same weights: the LoRA factors end
within 1e-5 of one device's, the frozen base is unchanged, and the bytes
of trainable and of frozen variables are counted on every device from
each variable's per-device components. keras-hub models are built small
(nothing is downloaded): `GemmaCausalLM` with `backbone.enable_lora(4)`
called after the strategy's scope closed (the model already sharded, as
keras-hub users call it after `from_preset`), `LlamaCausalLM` quantized
to int8 then LoRA'd inside the scope (QLoRA-style) at tensor 4; a stock
Dense MLP (float and int8); a GPT under pipeline x tensor and under
ZeRO-3. Other quantization modes, and LoRA on a split embedding, are
refused before any work.
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
  """LoRA factors within `atol` of one device's, everything else
  unchanged; the weights listed in one device's order."""
  got, want = tfpar.logical_weights(model), tfpar.logical_weights(reference)
  assert [w.path for w in model.weights] == [w.path for w in reference.weights]
  lora = [p for p in want if "lora_kernel" in p]
  assert lora
  worst = max(float(np.abs(got[p] - want[p]).max()) for p in lora)
  assert worst < atol, worst
  for path, value in initial.items():
    if "lora_kernel" not in path and "bias" not in path:
      np.testing.assert_array_equal(got[path], value, err_msg=path)
  # AdamW's slots: two per LoRA factor (and trainable bias), none for the
  # frozen kernels.
  assert len(model.optimizer.variables) == len(reference.optimizer.variables)
  return worst


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
