"""keras.distribution layouts on TensorFlow through
`tfpar.from_keras_distribution`: keras-hub's own `get_layout_map()` for
Llama, Gemma and Qwen2 trains like one device."""

import keras
import keras_hub
import numpy as np
import pytest

import hub_common
import tfpar

BACKBONES = {"llama": keras_hub.models.LlamaBackbone,
             "gemma": keras_hub.models.GemmaBackbone,
             "qwen2": keras_hub.models.QwenBackbone}


def _model_parallel(layout_map_of=None, shape=(2, 2)):
  mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"])
  layout_map = (layout_map_of(mesh) if layout_map_of else
                keras.distribution.LayoutMap(mesh))
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name="batch")


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_keras_hub_layout_map_trains_like_one_device(family):
  distribution = _model_parallel(BACKBONES[family].get_layout_map)
  strategy, callbacks = tfpar.from_keras_distribution(distribution)
  assert strategy.mesh.shape == {"data": 2, "pipeline": 1, "tensor": 2}
  # keras-hub's maps also put the batch axis on weights: ZeRO-3 over data.
  assert [(type(c).__name__, c.stage) for c in callbacks] == [("ZeRO", 3)]

  reference, reference_losses = hub_common.reference(family, "sgd")
  with strategy.scope():
    model = hub_common.language_model(family)
    model.compile(optimizer=hub_common.optimizer("sgd"),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  x, y = hub_common.data(family)
  history = model.fit(x, y, batch_size=hub_common.BATCH, epochs=1,
                      shuffle=False, verbose=0, callbacks=callbacks)
  assert abs(history.history["loss"][-1] - reference_losses[-1]) < 1e-5
  expected = tfpar.logical_weights(reference)
  got = tfpar.logical_weights(model)
  worst = max(float(np.abs(got[p] - expected[p]).max()) for p in expected)
  assert worst < 1e-5, worst

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


def test_set_distribution_on_tensorflow_points_to_tfpar():
  distribution = _model_parallel()
  with pytest.raises(ValueError, match="from_keras_distribution"):
    keras.distribution.set_distribution(distribution)
  with pytest.raises(ValueError, match="does nothing on the TensorFlow"):
    with distribution.scope():
      pass
  assert keras.distribution.distribution() is None


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
