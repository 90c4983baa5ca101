"""Keras's weight API speaks whole weights under tensor parallelism:
`model.weights` / `layer.weights` (their numpy values), `get_weights` /
`set_weights` and `count_params` give and take exactly what one device
has, while `trainable_weights` / `trainable_variables` list the shards
that training updates."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import tfpar
import tp_common
from tfpar._compat import Incompatible
from tfpar._compat import keras_weights_view
from tfpar.common import whole_weights


def _same_arrays(got, want):
  assert len(got) == len(want)
  assert [np.shape(g) for g in got] == [np.shape(w) for w in want]
  return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def _numpy(weights):
  return [w.numpy() for w in weights]


def _assert_lists_one_devices_weights(model, one_device, layer_name):
  """`model.weights` (and one layer's) read as one device's, by path and
  value; what training uses still lists the shards (one variable per
  weight, holding its shards on the devices)."""
  assert [w.path for w in model.weights] == [w.path for w in
                                              one_device.weights]
  assert _same_arrays(_numpy(model.weights), _numpy(one_device.weights)) == 0
  assert _same_arrays([np.asarray(w) for w in model.weights],
                      one_device.get_weights()) == 0
  assert _same_arrays([tf.convert_to_tensor(w).numpy()
                       for w in model.weights], one_device.get_weights()) == 0
  assert _same_arrays(model.get_weights(), one_device.get_weights()) == 0
  assert model.count_params() == one_device.count_params()
  layer, want = model.get_layer(layer_name), one_device.get_layer(layer_name)
  assert _same_arrays(_numpy(layer.weights), _numpy(want.weights)) == 0
  assert _same_arrays(layer.get_weights(), want.get_weights()) == 0
  assert layer.count_params() == want.count_params()
  for got, ref in zip(model.weights, one_device.weights):
    assert (tuple(got.shape), got.dtype, got.name, got.trainable) == (
        tuple(ref.shape), ref.dtype, ref.name, ref.trainable)
  # The trainer's list and the optimizer's: the shards, the same variables.
  held = whole_weights.held(model)
  split = [w for w in model.weights if isinstance(w, tfpar.ShardedWeight)]
  assert len(split) >= 8, split  # Attention and MLP kernels, at least.
  # Listed whole where the held variable of the shard's shape is.
  assert len(held) == len(one_device.weights)
  for variable, weight in zip(held, model.weights):
    if not isinstance(weight, tfpar.ShardedWeight):
      assert variable is weight
      continue
    shape = list(weight.shape)
    shape[weight.axis] //= len(weight.shards)
    assert list(variable.shape) == shape, (variable.path, weight.shape)
  assert [id(v) for v in model.trainable_weights] == [
      id(v) for v in held if v.trainable]
  assert sorted(map(id, model.trainable_weights)) == sorted(
      map(id, model.trainable_variables))
  # Keras serializes the class the user built.
  assert type(model) is not keras.Model and (
      model.__class__ is one_device.__class__)


@pytest.mark.parametrize("strategy_fn", [
    lambda: tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                     "tensor": 2})),
    lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2),
], ids=["data2_tensor2", "pipeline2_tensor2"])
def test_model_and_layer_weights_are_whole(strategy_fn):
  one_device = tp_common.gpt()
  strategy = strategy_fn()
  with strategy.scope():
    model = tp_common.gpt()
  x, _ = tp_common.data("gpt", count=8)
  model.predict(x, batch_size=8, verbose=0)  # Cut and split by now.
  _assert_lists_one_devices_weights(model, one_device, "block0_attention")

  # set_weights takes one device's arrays: new values, same predictions.
  rng = np.random.default_rng(7)
  fresh = [0.1 * rng.normal(size=w.shape).astype("float32")
           for w in one_device.get_weights()]
  one_device.set_weights(fresh)
  model.set_weights(fresh)
  assert _same_arrays(_numpy(model.weights), fresh) == 0
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             one_device.predict(x, verbose=0), atol=1e-5)

  # Assigning a listed whole weight (a split one) sets it as on one device.
  held_ids = {id(v) for v in whole_weights.held(model)}
  split = [i for i, w in enumerate(model.weights) if id(w) not in held_ids]
  assert len(split) >= 8, split  # Attention and MLP kernels, at least.
  before = one_device.predict(x, verbose=0)
  for index in split[:3]:
    value = rng.normal(size=one_device.weights[index].shape).astype("float32")
    one_device.weights[index].assign(value)
    model.weights[index].assign(value)
  after = one_device.predict(x, verbose=0)
  assert np.abs(after - before).max() > 1e-2  # The assignment mattered.
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             after, atol=1e-5)


def test_keras_hub_model_lists_one_devices_weights():
  one_device = hub_common.language_model("llama")
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = hub_common.language_model("llama")
  x, _ = hub_common.data("llama", count=8)
  model.predict(x, batch_size=8, verbose=0)
  _assert_lists_one_devices_weights(model, one_device,
                                    "transformer_layer_0")
  backbone = model.get_layer(one_device.layers[1].name)
  want = one_device.get_layer(backbone.name)
  assert _same_arrays(_numpy(backbone.weights), _numpy(want.weights)) == 0
  assert keras.saving.serialize_keras_object(backbone)["registered_name"] == (
      keras.saving.serialize_keras_object(want)["registered_name"])
  totals = []
  for m in (model, one_device):
    text = []
    m.summary(print_fn=lambda line, **_: text.append(line))
    totals.append([line for line in "".join(text).splitlines()
                   if "params:" in line])
  assert totals[0] == totals[1] and len(totals[0]) == 3


def test_set_weights_with_the_shard_count_is_refused():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = tp_common.mlp()
  model.predict(np.zeros((2, tp_common.WIDTH), "float32"), verbose=0)
  shards = [v.numpy() for v in whole_weights.held(model)]
  # One variable per weight: the count matches, the first split weight's
  # shape does not.
  index, weight = [(i, w) for i, w in enumerate(model.weights)
                   if isinstance(w, tfpar.ShardedWeight)][0]
  message = re.escape(
      f"weight shape {tuple(weight.shape)} is not compatible with "
      f"provided weight shape {shards[index].shape}")
  before = model.get_weights()
  with pytest.raises(ValueError, match=message):
    model.set_weights(shards)
  assert _same_arrays(model.get_weights(), before) == 0  # Nothing set.


# ZeRO stage 3 and pipeline stages hold whole-shaped Keras variables, so
# their `model.weights` read whole already (ZeRO-3 gathers the slices);
# under tensor + ZeRO-3 the listed whole weights gather sliced shards.
# Each layout: (strategy, ZeRO-3 as a callback).
_TWO_CPUS = ["/device:CPU:0", "/device:CPU:1"]
_LAYOUTS = {
    "zero3_callback": (lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 2}, _TWO_CPUS)), True),
    "zero3_option": (lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 2}, _TWO_CPUS), zero=tfpar.ZeRO(stage=3)), False),
    "pipeline2_data2": (lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2), False),
    "tensor2_data2_zero3": (lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})), True),
}


def _sgd_mlp():
  model = tp_common.mlp()
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  return model


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_weights_are_whole_under_zero_3_and_pipelines(layout):
  make_strategy, zero_callback = _LAYOUTS[layout]
  x, y = tp_common.data("mlp", count=4 * tp_common.BATCH)
  one_device = _sgd_mlp()
  with make_strategy().scope():
    model = _sgd_mlp()
  callbacks = [tfpar.ZeRO(stage=3)] if zero_callback else []
  for m, extra in ((one_device, []), (model, callbacks)):
    m.fit(tp_common.dataset(x, y), epochs=1, verbose=0, callbacks=extra)
  assert [w.path for w in model.weights] == [w.path for w in
                                              one_device.weights]
  # Measured: at most 6e-8 after 4 SGD steps.
  assert _same_arrays(_numpy(model.weights), _numpy(one_device.weights)) < (
      1e-5)
  assert _same_arrays(model.get_weights(), one_device.get_weights()) < 1e-5
  assert model.count_params() == one_device.count_params()
  # Assigning a listed weight sets it as on one device.
  rng = np.random.default_rng(3)
  value = rng.normal(size=one_device.weights[0].shape).astype("float32")
  before = one_device.predict(x, verbose=0)
  for m in (one_device, model):
    m.weights[0].assign(value)
  assert _same_arrays([model.weights[0].numpy()], [value]) == 0
  after = one_device.predict(x, verbose=0)
  assert np.abs(after - before).max() > 1e-2  # The assignment mattered.
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             after, atol=1e-5)


def test_a_keras_whose_optimizer_reads_weights_fails_loudly():
  """If a Keras upgrade built `trainable_variables` (the optimizer's list)
  from `weights`, the optimizer would get whole views, not the shards."""

  class TrainsOnWeights(keras.layers.Dense):

    @property
    def trainable_variables(self):
      return [v for v in self.weights if v.trainable]

  layer = TrainsOnWeights(2)
  layer.build((None, 3))
  with pytest.raises(Incompatible, match="trainable_variables"):
    keras_weights_view.show_weights_as(layer, lambda held: held[:1])
