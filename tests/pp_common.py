"""Models, data and the one-device reference shared by the pipeline tests."""

import functools

import keras
import numpy as np
import tensorflow as tf

import one_device_optimizer

WIDTH = 8
ROWS = 96
BATCH = 16
EPOCHS = 4  # 24 Adam steps.


def residual_chain(blocks=4, seed=7):
  """A Functional chain of residual blocks with regularizers: each block
  is Dense -> Dense + skip, so a stage may only start at a block."""
  inputs = keras.Input((WIDTH,), name="features")
  x = keras.layers.Dense(WIDTH, activation="tanh", name="embed",
                         kernel_regularizer=keras.regularizers.l2(1e-3))(
                             inputs)
  for b in range(blocks):
    h = keras.layers.Dense(2 * WIDTH, activation="tanh", name=f"block{b}_in",
                           activity_regularizer=keras.regularizers.l1(1e-3))(x)
    h = keras.layers.Dense(WIDTH, name=f"block{b}_out")(h)
    x = keras.layers.Add(name=f"block{b}_add")([x, h])
  outputs = keras.layers.Dense(3, name="head")(x)
  model = keras.Model(inputs, outputs, name="chain")
  rng = np.random.default_rng(seed)
  model.set_weights([0.3 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])
  return model


def data(rows=ROWS, seed=0):
  """Features, targets and sample weights."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, WIDTH)).astype("float32")
  y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3]], 1)
  return x, y.astype("float32"), rng.uniform(0.5, 1.5, rows).astype("float32")


def compile_model(model):
  model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                metrics=["mae"])


def train(strategy=None, model_fn=residual_chain, rows=ROWS, batch=BATCH,
          epochs=EPOCHS, callbacks=None):
  """Fits, evaluates and predicts; returns (history, evaluate, predict,
  weights, model)."""
  scope = strategy.scope() if strategy else tf.init_scope()
  with scope:
    model = model_fn()
    compile_model(model)
  x, y, sw = data(rows)
  one_device_optimizer.build(model)
  history = model.fit(x, y, sample_weight=sw, batch_size=batch,
                      epochs=epochs, shuffle=False, verbose=0,
                      callbacks=callbacks)
  evaluation = model.evaluate(x, y, sample_weight=sw, batch_size=batch,
                              verbose=0)
  prediction = model.predict(x, batch_size=batch, verbose=0)
  return (history.history, evaluation, prediction, model.get_weights(),
          model)


@functools.cache
def one_device():
  """`train()` without a strategy, run once per process and shared by the
  tests that compare with it. Callers must not train the model further."""
  return train()


def assert_same_training(reference, result, atol=1e-5):
  """Same losses and metrics every epoch, evaluation, predictions and
  final weights."""
  for key, values in reference[0].items():
    np.testing.assert_allclose(result[0][key], values, rtol=1e-5, atol=atol,
                               err_msg=key)
  np.testing.assert_allclose(result[1], reference[1], rtol=1e-5, atol=atol)
  np.testing.assert_allclose(result[2], reference[2], atol=atol)
  for got, want in zip(result[3], reference[3]):
    np.testing.assert_allclose(got, want, atol=atol)
