"""What the LoRA tests share: models with non-zero LoRA factors, AdamW,
and per-device bytes counted from every variable's components."""

import collections

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import hub_common
import one_device_optimizer
import tfpar


def strategy(layout):
  devices = tf.config.list_logical_devices("CPU")
  return tfpar.TensorParallelStrategy(tfpar.Mesh(layout, [
      d.name for d in devices[:layout["data"] * layout["tensor"]]]))


def causal_lm(family):
  keras.utils.set_random_seed(1)
  shape = dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
               hidden_dim=32, intermediate_dim=64)
  if family == "gemma":  # One key/value head: shared by every device.
    backbone = keras_hub.models.GemmaBackbone(num_key_value_heads=1,
                                              head_dim=8, **shape)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
  backbone = keras_hub.models.LlamaBackbone(num_key_value_heads=2, **shape)
  return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def set_lora(model, seed=3):
  """Non-zero factors (Keras starts `b` at zero), the same everywhere."""
  rng = np.random.default_rng(seed)
  for weight in model.weights:
    if "lora_kernel" in weight.path:
      weight.assign(0.2 * rng.normal(size=weight.shape).astype("float32"))


def compile_model(model):
  optimizer = keras.optimizers.AdamW(0.01)
  optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
  loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
          if hasattr(model, "backbone") else "mse")
  model.compile(optimizer=optimizer, loss=loss)


def fit(model, data):
  one_device_optimizer.build(model)
  model.fit(*data, batch_size=8, epochs=1, shuffle=False, verbose=0)


def hub_data():
  x, y = hub_common.data("llama", count=32)
  return x, y


def device_bytes(variables):
  """{device: bytes} of `variables` (those a model holds: shards, not
  whole weights), from each variable's per-device components."""
  found = collections.Counter()
  for variable in variables:
    value = variable._value  # pylint: disable=protected-access
    for component in getattr(value, "values", (value,)):
      found[tf.DeviceSpec.from_string(component.device).to_string()] += (
          int(np.prod(component.shape)) * component.dtype.size)
  return found


def one_device_bytes(variables, split):
  """Bytes of `variables` (one device's model), each divided by the tensor
  size where `split(path)` says the plan splits it."""
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size //
             split(v.path)
             for v in variables)


def assert_trains_like(model, reference, initial, atol=1e-5,
                       same_path=lambda path: path):
  """Weights within `atol` of one device's (LoRA factors trained), frozen
  ones unchanged; the weights listed in one device's order. `same_path`
  maps both models' paths to one name (Keras numbers the layers it names
  itself in order of creation). Returns the largest LoRA factor
  difference."""
  def logical(of):
    return {same_path(path): value
            for path, value in tfpar.logical_weights(of).items()}
  got, want = logical(model), logical(reference)
  initial = {same_path(path): value for path, value in initial.items()}
  assert ([same_path(w.path) for w in model.weights] ==
          [same_path(w.path) for w in reference.weights])
  assert max(float(np.abs(got[p] - want[p]).max()) for p in want) < atol
  lora = [p for p in want if "lora_kernel" in p]
  assert lora
  for weight in reference.non_trainable_weights:
    path = same_path(weight.path)
    np.testing.assert_array_equal(got[path], initial[path], err_msg=path)
  # AdamW's slots: two per trainable weight, none for the frozen kernels.
  assert len(model.optimizer.variables) == len(reference.optimizer.variables)
  return max(float(np.abs(got[p] - want[p]).max()) for p in lora)


def report(case, model, reference, worst):
  """Prints the largest LoRA difference and the bytes of trainable and
  frozen variables on the fullest device against one device's; returns
  {"trainable": (fullest, one), "frozen": (fullest, one)}."""
  found = {}
  for name, held, one in (
      ("trainable", model.trainable_variables, reference.trainable_variables),
      ("frozen", model.non_trainable_variables,
       reference.non_trainable_variables)):
    found[name] = (max(device_bytes(held).values()),
                   one_device_bytes(one, lambda path: 1))
  print(f"\nMEASURED {case}: LoRA weights {worst:.1e}; bytes on the fullest "
        f"device / one device's: trainable {found['trainable'][0]} / "
        f"{found['trainable'][1]}, frozen {found['frozen'][0]} / "
        f"{found['frozen'][1]}")
  return found


def assert_saved_like(model, reference, build, tmp_path):
  """`model.save_weights` writes one device's file: Keras's own format
  (LoRA merged into the kernel; an int8 kernel re-quantized with it, one
  step apart at most), loaded into `build()` on one device."""
  loaded = []
  for name, saving in (("tp", model), ("one", reference)):
    saving.save_weights(str(tmp_path / f"{name}.weights.h5"))
    fresh = build()
    fresh.load_weights(str(tmp_path / f"{name}.weights.h5"))
    loaded.append(tfpar.logical_weights(fresh))
  for name, want in loaded[1].items():
    np.testing.assert_allclose(
        loaded[0][name].astype("float64"), want, rtol=1e-5,
        atol=1 if want.dtype == np.int8 else 1e-6, err_msg=name)
