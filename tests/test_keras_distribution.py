"""keras.distribution on TensorFlow: `tfpar.from_keras_distribution`
(keras-hub's own `get_layout_map()` for Llama, Gemma and Qwen2 trains like
one device) and `keras.distribution.set_distribution` once tfpar is
imported (Keras's guide flow with no scope and no callbacks, laid out as
the map says, and undone by `set_distribution(None)`)."""

import collections
import functools
import os
import subprocess
import sys
import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import tfpar
from tfpar.common import whole_weights

BACKBONES = {"llama": keras_hub.models.LlamaBackbone,
             "gemma": keras_hub.models.GemmaBackbone,
             "qwen2": keras_hub.models.QwenBackbone}


def _model_parallel(layout_map_of=None, shape=(2, 2)):
  mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"])
  layout_map = (layout_map_of(mesh) if layout_map_of else
                keras.distribution.LayoutMap(mesh))
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name="batch")


def _assert_trained_like(model, history, reference, reference_losses):
  """The last loss and every whole weight within 1e-5 of one device's."""
  assert abs(history.history["loss"][-1] - reference_losses[-1]) < 1e-5
  expected = tfpar.logical_weights(reference)
  got = tfpar.logical_weights(model)
  worst = max(float(np.abs(got[p] - expected[p]).max()) for p in expected)
  assert worst < 1e-5, worst


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_keras_hub_layout_map_trains_like_one_device(family):
  distribution = _model_parallel(BACKBONES[family].get_layout_map)
  strategy, callbacks = tfpar.from_keras_distribution(distribution)
  assert strategy.mesh.shape == {"data": 2, "pipeline": 1, "tensor": 2}
  # keras-hub's maps also put the batch axis on weights: the strategy's
  # own ZeRO-3 over data, no callback.
  assert callbacks == [] and strategy.extended.zero.stage == 3

  reference, reference_losses = hub_common.reference(family, "sgd")
  with strategy.scope():
    model = hub_common.language_model(family)
    model.compile(optimizer=hub_common.optimizer("sgd"),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  x, y = hub_common.data(family)
  history = model.fit(x, y, batch_size=hub_common.BATCH, epochs=1,
                      shuffle=False, verbose=0, callbacks=callbacks)
  _assert_trained_like(model, history, reference, reference_losses)

  # Every block kernel the map splits over "model" is split over tensor,
  # and ZeRO-3 spreads it over the 2 replicas too: each device holds about
  # a quarter of the model, counted from the per-device variables.
  held = hub_common.bytes_by_device(model)
  total = sum(hub_common.bytes_by_device(reference).values())
  assert len(held) == 4
  assert max(held.values()) < 0.3 * total, (held, total)


def test_data_parallel_becomes_data_parallel_strategy():
  devices = keras.distribution.list_devices()
  strategy, callbacks = tfpar.from_keras_distribution(
      keras.distribution.DataParallel(devices=devices))
  assert isinstance(strategy, tfpar.DataParallelStrategy)
  assert strategy.num_replicas_in_sync == len(devices) and callbacks == []


def _mlp():
  """A small functional model: "up" and "down" as a Megatron MLP, "out"
  left to Keras's rule (unmapped: replicated)."""
  inputs = keras.Input((8,))
  hidden = keras.layers.Dense(32, activation="relu", name="up")(inputs)
  hidden = keras.layers.Dense(8, name="down")(hidden)
  return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))


def _mlp_data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(24, 8)).astype("float32"),
          rng.normal(size=(24, 1)).astype("float32"))


@functools.lru_cache(maxsize=None)
def _mlp_initial_weights():
  keras.utils.set_random_seed(3)
  return tuple(_mlp().get_weights())


def _guide_flow():
  """What Keras's distribution guide does once a distribution is set:
  build, compile, fit, predict, with no scope and no callbacks.
  Returns (model, predictions)."""
  model = _mlp()
  model.set_weights(list(_mlp_initial_weights()))
  model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss="mse")
  x, y = _mlp_data()
  model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  return model, model.predict(x, batch_size=8, verbose=0)


@functools.lru_cache(maxsize=None)
def _one_device():
  assert not tf.distribute.has_strategy()
  model, predictions = _guide_flow()
  return tfpar.logical_weights(model), predictions


def _differences(model, predictions):
  expected, expected_predictions = _one_device()
  got = tfpar.logical_weights(model)
  assert sorted(got) == sorted(expected)
  return (max(float(np.abs(got[p] - expected[p]).max()) for p in expected),
          float(np.abs(predictions - expected_predictions).max()))


def _bytes_by_device(model):
  """{variable path: {device: bytes}}, counted from every component of
  every variable the model holds (tensor shards, not whole weights)."""
  held = {}
  for variable in whole_weights.held(model):
    value = variable.value
    counts = collections.Counter()
    for component in getattr(value, "values", (value,)):
      counts[tf.DeviceSpec.from_string(component.device).to_string()] += (
          int(np.prod(component.shape)) * component.dtype.size)
    held[variable.path] = counts
  return held


@pytest.fixture
def no_distribution():
  """Leaves no distribution set, whatever the test does."""
  yield
  keras.distribution.set_distribution(None)
  assert not tf.distribute.has_strategy()


def test_set_distribution_model_parallel_trains_as_the_map_says(
    no_distribution):
  _one_device()  # First, with no distribution set.
  mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map["up/kernel"] = (None, "model")
  layout_map["up/bias"] = ("model",)
  layout_map["down/kernel"] = ("model", None)
  # An activation's layout (Keras's relayout on JAX): tfpar's own on TF.
  layout_map["up/output"] = ("batch", None)
  distribution = keras.distribution.ModelParallel(
      layout_map=layout_map, batch_dim_name="batch")
  keras.distribution.set_distribution(distribution)
  assert keras.distribution.distribution() is distribution
  strategy = tf.distribute.get_strategy()
  assert isinstance(strategy, tfpar.TensorParallelStrategy)
  assert strategy.mesh.shape == {"data": 2, "pipeline": 1, "tensor": 2}

  with pytest.warns(UserWarning, match="lays out a layer's output"):
    model, predictions = _guide_flow()
  assert model.distribute_strategy is strategy
  weights, outputs = _differences(model, predictions)
  assert weights < 1e-5 and outputs < 1e-5, (weights, outputs)

  # Split weights: half of each on every device; the rest whole on every
  # device. Counted from the variables' components, not from the plan.
  devices = {tf.DeviceSpec.from_string(d).to_string()
             for d in strategy.mesh.devices}
  whole = {path: value.nbytes for path, value in _one_device()[0].items()}
  held = _bytes_by_device(model)
  assert sorted(held) == sorted(whole)
  for path, counts in held.items():
    share = 2 if path in ("up/kernel", "up/bias", "down/kernel") else 1
    assert counts == {d: whole[path] // share for d in devices}, (
        path, counts)

  keras.distribution.set_distribution(None)
  assert keras.distribution.distribution() is None
  assert not tf.distribute.has_strategy()
  assert _mlp().distribute_strategy is tf.distribute.get_strategy()


def test_set_distribution_data_parallel_trains_like_one_device(
    no_distribution):
  _one_device()
  distribution = keras.distribution.DataParallel()
  keras.distribution.set_distribution(distribution)
  assert keras.distribution.distribution() is distribution
  model, predictions = _guide_flow()
  assert isinstance(model.distribute_strategy, tfpar.DataParallelStrategy)
  assert model.distribute_strategy.num_replicas_in_sync == 4
  weights, outputs = _differences(model, predictions)
  assert weights < 1e-5 and outputs < 1e-5, (weights, outputs)
  whole = {path: value.nbytes for path, value in _one_device()[0].items()}
  for path, counts in _bytes_by_device(model).items():
    assert len(counts) == 4 and set(counts.values()) == {whole[path]}
  keras.distribution.set_distribution(None)
  assert keras.distribution.distribution() is None
  assert not tf.distribute.has_strategy()


def test_distribution_scope_sets_and_restores(no_distribution):
  outer = keras.distribution.DataParallel()
  mesh = keras.distribution.DeviceMesh((4, 1), ["batch", "model"])
  inner = keras.distribution.ModelParallel(
      layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")
  with outer.scope():
    outer_strategy = tf.distribute.get_strategy()
    with inner.scope():
      assert keras.distribution.distribution() is inner
      inner_strategy = tf.distribute.get_strategy()
      assert inner_strategy.mesh.shape["data"] == 4
      assert inner_strategy is not outer_strategy
    # The same strategy as before the inner scope: models made then keep it.
    assert keras.distribution.distribution() is outer
    assert tf.distribute.get_strategy() is outer_strategy
  assert keras.distribution.distribution() is None
  assert not tf.distribute.has_strategy()


def test_batch_axis_entries_fold_into_the_strategy(no_distribution):
  """FSDP-style entries on a mesh whose model axis has one device: a
  DataParallelStrategy that applies ZeRO-3 itself, no callback."""
  mesh = keras.distribution.DeviceMesh((4, 1), ["batch", "model"])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map["up/kernel"] = ("batch", "model")
  distribution = keras.distribution.ModelParallel(
      layout_map=layout_map, batch_dim_name="batch")
  strategy, callbacks = tfpar.from_keras_distribution(distribution)
  assert callbacks == []
  assert isinstance(strategy, tfpar.DataParallelStrategy)
  assert strategy.extended.zero.stage == 3


def test_keras_hub_map_under_set_distribution_spreads_over_both_axes(
    no_distribution):
  """keras-hub's maps also spread weights over the batch axis: with a model
  axis too, the TensorParallelStrategy set as default applies ZeRO-3
  itself, so ordinary Keras code with no callback spreads them."""
  reference, reference_losses = hub_common.reference("llama", "sgd")
  distribution = _model_parallel(keras_hub.models.LlamaBackbone.get_layout_map)
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    keras.distribution.set_distribution(distribution)
  assert isinstance(tf.distribute.get_strategy(),
                    tfpar.TensorParallelStrategy)
  # Ordinary Keras code: no scope, no callbacks.
  model = hub_common.language_model("llama")
  model.compile(optimizer=hub_common.optimizer("sgd"),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  x, y = hub_common.data("llama")
  history = model.fit(x, y, batch_size=hub_common.BATCH, epochs=1,
                      shuffle=False, verbose=0)
  assert model.distribute_strategy is tf.distribute.get_strategy()
  _assert_trained_like(model, history, reference, reference_losses)
  # Split over the model axis and spread over the batch axis: about a
  # quarter of the model on each device.
  held = hub_common.bytes_by_device(model)
  total = sum(hub_common.bytes_by_device(reference).values())
  assert len(held) == 4
  assert max(held.values()) < 0.3 * total, (held, total)


def test_set_distribution_inside_a_strategy_scope_is_refused(
    no_distribution):
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  with strategy.scope():
    with pytest.raises(ValueError, match="outside any strategy scope"):
      keras.distribution.set_distribution(keras.distribution.DataParallel())
  assert keras.distribution.distribution() is None


def test_set_distribution_is_tfpars_whatever_was_imported_first():
  """`import tfpar` before TensorFlow and Keras (TensorFlow looks Keras up
  without importing it) still hooks Keras as it is imported."""
  script = ("import tfpar, tensorflow, keras\n"
            "from tfpar import keras_distribution\n"
            "assert (keras.distribution.set_distribution is\n"
            "        keras_distribution.set_distribution)\n")
  subprocess.run([sys.executable, "-c", script], check=True,
                 env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def test_layout_tfpar_cannot_carry_out_names_the_variable():
  def norm_split(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*self_attention_layernorm/scale"] = ("model",)
    return layout_map
  strategy, _ = tfpar.from_keras_distribution(_model_parallel(norm_split))
  with pytest.raises(ValueError,
                     match="transformer_layer_0/self_attention_layernorm"):
    with strategy.scope():
      hub_common.language_model("llama")


def test_three_axis_mesh_is_refused():
  mesh = keras.distribution.DeviceMesh((1, 2, 2), ["batch", "seq", "model"])
  with pytest.raises(ValueError, match="axis_names=\\['batch', 'seq'"):
    tfpar.from_keras_distribution(keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh),
        batch_dim_name="batch"))
