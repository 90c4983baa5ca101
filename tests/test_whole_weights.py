"""Keras's weight API speaks whole weights under tensor parallelism:
`get_weights` / `set_weights` give and take exactly what one device has."""

import keras
import numpy as np
import pytest

import hub_common
import tfpar
import tp_common


def _same_arrays(got, want):
  assert len(got) == len(want)
  assert [np.shape(g) for g in got] == [np.shape(w) for w in want]
  return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


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
  assert len(model.weights) > len(one_device.weights)  # Shards inside.
  assert _same_arrays(model.get_weights(), one_device.get_weights()) == 0
  attention = model.get_layer("block0_attention")
  assert _same_arrays(attention.get_weights(), one_device.get_layer(
      "block0_attention").get_weights()) == 0

  # set_weights takes one device's arrays: new values, same predictions.
  rng = np.random.default_rng(7)
  fresh = [0.1 * rng.normal(size=w.shape).astype("float32")
           for w in one_device.get_weights()]
  one_device.set_weights(fresh)
  model.set_weights(fresh)
  assert _same_arrays(model.get_weights(), fresh) == 0
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             one_device.predict(x, verbose=0), atol=1e-5)


def test_keras_hub_model_lists_one_devices_weights():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 1,
                                                      "tensor": 4}))
  with strategy.scope():
    model = hub_common.language_model("gemma")
  assert _same_arrays(model.get_weights(), hub_common.language_model(
      "gemma").get_weights()) == 0


def test_set_weights_with_the_shard_count_is_refused():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = tp_common.mlp()
  shards = [v.numpy() for v in model.weights]
  with pytest.raises(ValueError, match=(
      f"weight list of length {len(shards)}, but the layer was expecting "
      f"{len(tp_common.mlp().weights)} weights")):
    model.set_weights(shards)
