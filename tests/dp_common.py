"""Model, data and one-device reference shared by the data-parallel tests.

Imported by the tests and by the worker script that `tfpar launch` runs, so
that every layout trains exactly the same model on exactly the same batches.
"""

import keras
import numpy as np

import one_device_optimizer

FEATURES = 8
GLOBAL_BATCH = 32
STEPS_PER_EPOCH = 8
EPOCHS = 3  # 24 optimizer steps


def make_data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(GLOBAL_BATCH * STEPS_PER_EPOCH, FEATURES))
  true_w = rng.normal(size=(FEATURES, 1))
  y = np.tanh(x @ true_w) + 0.1 * rng.normal(size=(len(x), 1))
  return x.astype("float32"), y.astype("float32")


def build_model(seed=1, gradient_accumulation_steps=None):
  """A small MLP with deterministic initial weights, compiled with Adam
  (accumulating gradients over `gradient_accumulation_steps` batches)."""
  model = keras.Sequential([
      keras.Input((FEATURES,)),
      keras.layers.Dense(32, activation="relu"),
      keras.layers.Dense(16, activation="tanh"),
      keras.layers.Dense(1),
  ])
  rng = np.random.default_rng(seed)
  model.set_weights([0.3 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])
  model.compile(optimizer=keras.optimizers.Adam(
      learning_rate=0.01,
      gradient_accumulation_steps=gradient_accumulation_steps),
                loss="mse", metrics=["mae"])
  return model


def fit(model, x, y, epochs=EPOCHS, **kwargs):
  """Fits on fixed, unshuffled global batches; returns the history dict."""
  one_device_optimizer.build(model)
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs,
                      shuffle=False, verbose=0, **kwargs)
  return history.history


# What a worker script's callback raises to stand for a crash of the job.
INTERRUPTED = "interrupted"


def fit_unless_interrupted(model, x, y, **kwargs):
  """`model.fit(x, y, **kwargs)`; False when a callback raised
  `RuntimeError(INTERRUPTED)` (a crash the scenario stages), True when the
  fit ran to its end. Any other error propagates."""
  try:
    model.fit(x, y, **kwargs)
  except RuntimeError as error:
    if INTERRUPTED not in str(error):
      raise
    return False
  return True


def fit_one_iterator(model, x, y, epochs=EPOCHS, **kwargs):
  """`fit` batch for batch and epoch for epoch, from one input iterator.

  Under a 4-replica strategy Keras makes a new distributed iterator every
  epoch, about a second each on the test machine. The data repeated
  `epochs` times with `steps_per_epoch` set gives the same batches in the
  same order and the same history from a single iterator.
  """
  steps = len(x) // GLOBAL_BATCH
  assert steps * GLOBAL_BATCH == len(x), "whole batches only"
  return fit(model, np.tile(x, (epochs, 1)), np.tile(y, (epochs, 1)),
             epochs=epochs, steps_per_epoch=steps, **kwargs)


def step_losses(model, x, y, epochs=EPOCHS):
  """Loss of every optimizer step, recorded by a callback."""
  losses = []
  # Keras reports the running mean of the epoch; the per-step loss is
  # recovered from consecutive running means.
  class Record(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      losses.append((batch, logs["loss"]))

  fit(model, x, y, epochs=epochs, callbacks=[Record()])
  per_step = []
  for batch, mean in losses:
    previous = losses[len(per_step) - 1][1] if batch else 0.0
    per_step.append(mean * (batch + 1) - previous * batch)
  return np.array(per_step)
