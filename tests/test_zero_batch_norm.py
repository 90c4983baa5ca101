"""Batch normalization under data parallelism and under ZeRO-3, which
recomputes each unit's call in the backward pass: the moving statistics
take each batch once, so a model with `BatchNormalization(synchronized=
True)` trains and infers as on one device, and one with Keras's default
(per-replica statistics) as data parallelism without ZeRO does."""

import functools

import keras
import numpy as np
import pytest

import tfpar

BATCH, STEPS, EPOCHS = 16, 4, 2


def _model(synchronized):
  """Convolution and dense blocks without biases before their batch
  normalizations (a bias there has no gradient but rounding noise)."""
  keras.utils.set_random_seed(5)
  inputs = keras.Input((6, 6, 3))
  h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False,
                          name="conv")(inputs)
  h = keras.layers.BatchNormalization(synchronized=synchronized,
                                      name="conv_bn")(h)
  h = keras.layers.ReLU()(h)
  h = keras.layers.GlobalAveragePooling2D()(h)
  h = keras.layers.Dense(16, use_bias=False, name="dense")(h)
  h = keras.layers.BatchNormalization(synchronized=synchronized,
                                      name="dense_bn")(h)
  h = keras.layers.ReLU()(h)
  outputs = keras.layers.Dense(4, name="head")(h)
  model = keras.Model(inputs, outputs, name="bn_net")
  model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _data():
  rng = np.random.default_rng(0)
  count = BATCH * STEPS
  # Rows of different scales, so each replica's statistics differ.
  scale = np.linspace(0.3, 3.0, count, dtype="float32")[:, None, None, None]
  x = (rng.normal(size=(count, 6, 6, 3)) * scale + 0.5).astype("float32")
  return x, rng.integers(0, 4, size=(count,))


@functools.cache
def _trained(layout, synchronized, zero_stage):
  """(epoch losses, weights by path, evaluate loss) of `_model` fitted on
  one device (layout None) or under `layout`'s strategy with ZeRO at
  `zero_stage` (0: none)."""
  x, y = _data()
  if layout is None:
    model = _model(synchronized)
  else:
    strategy = (tfpar.PipelineParallelStrategy(
        tfpar.Mesh(dict(layout)), num_microbatches=1)
                if dict(layout).get("pipeline") else
                tfpar.DataParallelStrategy(tfpar.Mesh(dict(layout))))
    with strategy.scope():
      model = _model(synchronized)
  callbacks = [tfpar.ZeRO(stage=zero_stage)] if zero_stage else []
  history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                      verbose=0, callbacks=callbacks)
  weights = {w.path: np.array(w.numpy()) for w in model.weights}
  evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
  return np.array(history.history["loss"]), weights, evaluated


def _max_difference(weights, reference):
  assert sorted(weights) == sorted(reference)
  return max(float(np.abs(weights[p] - reference[p]).max())
             for p in reference)


@pytest.mark.parametrize(
    "layout,zero_stage",
    [((("data", 4),), 0), ((("data", 4),), 3),
     ((("data", 2), ("pipeline", 2)), 3)],
    ids=["data4", "data4_zero3", "data2_pipeline2_zero3"])
def test_synchronized_statistics_match_one_device(layout, zero_stage):
  losses, weights, evaluated = _trained(layout, True, zero_stage)
  ref_losses, ref_weights, ref_evaluated = _trained(None, True, 0)
  np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
  moved = float(np.abs(ref_weights["conv_bn/moving_mean"]).max())
  assert moved > 1e-2, moved  # The statistics did take the batches.
  for path in ("conv_bn/moving_mean", "conv_bn/moving_variance",
               "dense_bn/moving_mean", "dense_bn/moving_variance"):
    np.testing.assert_allclose(weights[path], ref_weights[path], atol=1e-5,
                               err_msg=path)
  difference = _max_difference(weights, ref_weights)
  print(f"\n{dict(layout)} ZeRO-{zero_stage}: weights within {difference:.1e} of one "
        f"device; evaluate {evaluated:.6f} vs {ref_evaluated:.6f}")
  assert difference < 1e-5
  # Inference reads the moving statistics.
  assert abs(evaluated - ref_evaluated) < 1e-5


def test_per_replica_statistics_under_zero3_match_data_parallelism():
  """Keras's default (`synchronized=False`) normalizes each replica's
  batch alone, as stock MirroredStrategy does; ZeRO-3 changes nothing."""
  layout = (("data", 4),)
  losses, weights, evaluated = _trained(layout, False, 3)
  plain_losses, plain_weights, plain_evaluated = _trained(layout, False, 0)
  one_losses, _, _ = _trained(None, False, 0)
  # Per-replica statistics are not one device's: a check that could fail.
  assert np.abs(plain_losses - one_losses).max() > 1e-4
  np.testing.assert_allclose(losses, plain_losses, atol=1e-6)
  assert _max_difference(weights, plain_weights) < 1e-6
  assert abs(evaluated - plain_evaluated) < 1e-6
