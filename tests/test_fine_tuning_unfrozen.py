"""Keras's transfer-learning guide under every layout: a base model frozen
(`base.trainable = False`), the head trained, then the base unfrozen, the
model compiled again with a lower learning rate and trained on
(https://keras.io/guides/transfer_learning/, "fine-tuning"). Equal to one
device in losses and weights.

Found on 2026-11-29: a weight a parallelism replaces while its layer is
frozen (tensor shards, expert slices) was created as a non-trainable
TensorFlow variable, which a gradient tape does not record; once unfrozen
it stayed as it was, silently (data 2 x tensor 2: the split kernels got
no update, 0.26 from one device after one SGD step). Under
`DataParallelStrategy(zero=tfpar.ZeRO(stage=3))` the frozen weights were
left spread and the first `fit` failed inside tfpar."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar

ROWS, FEATURES = 64, 8


def _model(moe):
  """A base (two Dense layers, or a Dense and a tfpar.MoE) called as a
  layer by the model with a Dense head."""
  keras.utils.set_random_seed(2)
  inputs = keras.Input((FEATURES,))
  h = keras.layers.Dense(16, activation="relu", name="b1")(inputs)
  if moe:
    h = keras.layers.Reshape((1, 16))(h)
    h = keras.layers.Add()([h, tfpar.MoE(4, 8, name="experts")(h)])
    h = keras.layers.Reshape((16,))(h)
  else:
    h = keras.layers.Dense(16, activation="relu", name="b2")(h)
  base = keras.Model(inputs, h, name="base")
  outer = keras.Input((FEATURES,))
  outputs = keras.layers.Dense(1, name="head")(base(outer, training=False))
  return keras.Model(outer, outputs), base


def _guide(strategy, moe=False, callbacks=None):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
  y = rng.normal(size=(ROWS, 1)).astype("float32")
  scope = strategy.scope if strategy else tf.init_scope
  with scope():
    model, base = _model(moe)
    base.trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  losses = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                     verbose=0, callbacks=callbacks).history["loss"]
  with scope():
    base.trainable = True
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
  losses += model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      verbose=0, callbacks=callbacks).history["loss"]
  return model, losses


LAYOUTS = {
    "data4_zero3": (lambda: tfpar.DataParallelStrategy(
        zero=tfpar.ZeRO(stage=3)), False),
    "data2_tensor2": (lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})), False),
    "data2_pipeline2": (lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2), False),
    "expert4": (lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": 4}), expert=4), True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_frozen_then_unfrozen_base_trains_like_one_device(layout):
  make, moe = LAYOUTS[layout]
  reference, reference_losses = _guide(None, moe)
  model, losses = _guide(make(), moe)
  np.testing.assert_allclose(losses, reference_losses, atol=1e-6)
  for got, want, weight in zip(model.get_weights(), reference.get_weights(),
                               model.weights):
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=weight.path)
  # The base moved in the second half (the test fails if it stayed).
  frozen, _ = _model(moe)
  moved = [float(np.max(np.abs(a - b))) for a, b, w in zip(
      reference.get_weights(), frozen.get_weights(), reference.weights)
           if w.path.startswith(("b1", "b2", "experts"))]
  assert moved and min(moved) > 1e-4, moved
