"""tfpar.ZeRO under TensorParallelStrategy(spmd=True): each tensor column
(the devices with the same tensor index across data replicas) slices its
devices' optimizer state (stage 1) and gradients (stage 2) over the data
replicas, as Megatron + DeepSpeed run ZeRO over each tensor rank's
data-parallel group.

The one-block GPT of tp_common at data 2 x tensor 2 is compared with the
same model fitted on one device with the same optimizer: every step's
loss and every whole weight; the optimizer slots each device holds are
counted from the variables' components and held to the ZeRO formula; the
saved optimizer state equals one device's, and loads back.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
import tp_common

STEPS = 6
LAYOUT = {"data": 2, "tensor": 2}
# stage -> the optimizer's settings: clipping per weight and accumulation
# (whole accumulators, saved column by column) at stage 1; global
# clipping with the embeddings' sparse gradients at stage 2.
SETTINGS = {1: dict(clipnorm=0.02, gradient_accumulation_steps=2),
            2: dict(global_clipnorm=0.1)}


def _model(settings):
  keras.utils.set_random_seed(0)
  model = tp_common.gpt(blocks=1)
  model.compile(
      optimizer=keras.optimizers.Adam(0.01, **settings),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _data():
  return tp_common.data("gpt", count=tp_common.BATCH * STEPS)


def _strategy():
  devices = tf.config.list_logical_devices("CPU")[:4]
  return tfpar.TensorParallelStrategy(
      tfpar.Mesh(LAYOUT, [d.name for d in devices]), spmd=True)


@pytest.fixture(scope="module")
def runs():
  """stage -> (reference, its losses, strategy, model, its losses)."""
  done = {}

  def run(stage):
    if stage not in done:
      reference = _model(SETTINGS[stage])
      expected = tp_common.step_losses(reference, *_data(), epochs=1)
      strategy = _strategy()
      with strategy.scope():
        model = _model(SETTINGS[stage])
      losses = tp_common.step_losses(model, *_data(), epochs=1,
                                     callbacks=[tfpar.ZeRO(stage=stage)])
      done[stage] = (reference, expected, strategy, model, losses)
    return done[stage]
  return run


@pytest.mark.parametrize("stage", [1, 2])
def test_trains_like_one_device(runs, stage):
  reference, expected, _, model, losses = runs(stage)
  assert len(losses) == STEPS
  tp_common.assert_trains_like(model, losses, reference, expected)


def _device(name):
  spec = tf.DeviceSpec.from_string(name)
  return f"{spec.device_type}:{spec.device_index}"


@pytest.mark.parametrize("stage", [1, 2])
def test_each_device_holds_its_slice_of_its_shards_state(runs, stage):
  _, _, strategy, model, _ = runs(stage)
  data = LAYOUT["data"]
  devices = [_device(d) for g in strategy.mesh.replicas for d in g]
  # Counted from the optimizer's variables' per-device components.
  held = dict.fromkeys(devices, 0)
  slots = [v for v in model.optimizer.variables
           if v.name.endswith(("_momentum", "_velocity", "_zero_slice",
                               "_gradient_accumulator"))]
  for variable in slots:
    components = variable.value.values
    assert [_device(c.device) for c in components] == devices
    for component in components:
      held[_device(component.device)] += (
          component.shape.num_elements() * component.dtype.size)
  # The formula: each trainable variable (a split weight's is its shard)
  # has Adam's two moments and the updated weight slice in 1/data slices;
  # with accumulation, stage 1 accumulates whole shards, stage 2 slices.
  sliced = sum(4 * math.ceil(v.shape.num_elements() / data)
               for v in model.trainable_variables)
  whole = sum(4 * v.shape.num_elements() for v in model.trainable_variables)
  accumulators = (0 if "gradient_accumulation_steps" not in SETTINGS[stage]
                  else whole if stage == 1 else sliced)
  expected = 3 * sliced + accumulators
  # 1/data of each shard, up to the padding of one slice (< 1 element).
  assert 0 <= sliced - whole / data < 4 * len(model.trainable_variables)
  assert held == dict.fromkeys(devices, expected)
  # Against the same model's slots without ZeRO (every device: 2 x whole
  # for Adam's moments, plus the accumulators).
  assert expected < (2 + 1) * whole


@pytest.mark.parametrize("stage", [1, 2])
def test_saved_optimizer_state_is_one_devices(runs, stage, tmp_path):
  reference, _, _, model, _ = runs(stage)
  path = str(tmp_path / "zero.weights.h5")
  model.save_weights(path)
  loaded = _model(SETTINGS[stage])
  loaded.optimizer.build(loaded.trainable_variables)
  loaded.load_weights(path)
  assert len(loaded.optimizer.variables) == len(
      reference.optimizer.variables)
  for got, want in zip(loaded.optimizer.variables,
                       reference.optimizer.variables):
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5,
                               rtol=0, err_msg=want.path)
  # And back: one device's state loaded into the ZeRO model saves again
  # as it was (every column's slices written).
  path = str(tmp_path / "one_device.weights.h5")
  reference.save_weights(path)
  model.load_weights(path)
  again = str(tmp_path / "again.weights.h5")
  model.save_weights(again)
  loaded.load_weights(again)
  for got, want in zip(loaded.optimizer.variables,
                       reference.optimizer.variables):
    np.testing.assert_array_equal(got.numpy(), want.numpy(),
                                  err_msg=want.path)
  for got, want in zip(loaded.get_weights(), reference.get_weights()):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("zero,message", [
    (dict(stage=3), r"stages 1 and 2.*stage=3"),
    (dict(stage=2, offload="cpu"), r"offload='cpu'")])
def test_unbuilt_settings_raise_before_any_work(zero, message):
  x, y = tp_common.data("mlp", count=8)
  devices = tf.config.list_logical_devices("CPU")[:2]
  with tfpar.TensorParallelStrategy(
      tfpar.Mesh({"tensor": 2}, [d.name for d in devices]),
      spmd=True).scope():
    model = tp_common.mlp()
    model.compile(optimizer="adam", loss="mse")
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(ValueError, match=message):
    model.fit(x, y, batch_size=8, verbose=0,
              callbacks=[tfpar.ZeRO(**zero)])
  assert not model.optimizer.built
  for got, want in zip(model.get_weights(), before):
    np.testing.assert_array_equal(got, want)
