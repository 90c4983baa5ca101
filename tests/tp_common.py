"""Models, data and references shared by the tensor-parallel tests."""

import contextlib
import functools
import types

import keras
import numpy as np
import tensorflow as tf

import one_device_optimizer
import tfpar

VOCAB = 32
SEQUENCE = 8
WIDTH = 16
HEADS = 4
BLOCKS = 2
BATCH = 8
STEPS = 12


def gpt(vocab=VOCAB, heads=HEADS, blocks=BLOCKS, width=WIDTH, seed=3):
  """A small GPT: token + position embeddings, pre-LayerNorm causal
  attention and GELU MLP blocks, a LayerNorm and a vocabulary head."""
  tokens = keras.Input((SEQUENCE,), dtype="int32")
  x = keras.layers.Embedding(vocab, width, name="tokens")(tokens)
  positions = keras.ops.zeros_like(tokens) + keras.ops.arange(SEQUENCE)
  positions = keras.layers.Embedding(SEQUENCE, width, name="positions")(
      positions)
  x = x + positions
  for b in range(blocks):
    h = keras.layers.LayerNormalization(name=f"block{b}_ln1")(x)
    h = keras.layers.MultiHeadAttention(heads, width // heads,
                                        name=f"block{b}_attention")(
                                            h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(name=f"block{b}_ln2")(x)
    h = keras.layers.Dense(4 * width, activation="gelu",
                           name=f"block{b}_mlp_in")(h)
    x = x + keras.layers.Dense(width, name=f"block{b}_mlp_out")(h)
  x = keras.layers.LayerNormalization(name="final_ln")(x)
  logits = keras.layers.Dense(vocab, name="lm_head")(x)
  model = keras.Model(tokens, logits, name="gpt")
  _deterministic_weights(model, seed)
  return model


def mlp(seed=4):
  """A plain MLP: two Dense pairs and a head."""
  model = keras.Sequential([
      keras.Input((WIDTH,)),
      keras.layers.Dense(64, activation="relu", name="pair1_in"),
      keras.layers.Dense(WIDTH, name="pair1_out"),
      keras.layers.Dense(32, activation="tanh", name="pair2_in"),
      keras.layers.Dense(4, name="pair2_out"),
  ], name="mlp")
  _deterministic_weights(model, seed)
  return model


def _deterministic_weights(model, seed):
  rng = np.random.default_rng(seed)
  model.set_weights([0.2 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])


def compile_model(model, **optimizer_kwargs):
  loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
          if model.name == "gpt" else "mse")
  model.compile(optimizer=keras.optimizers.Adam(0.01, **optimizer_kwargs),
                loss=loss)
  return model


def data(model_name, count=BATCH * STEPS, seed=0):
  """(x, y) arrays: next-token pairs for the GPT, a regression for the MLP."""
  rng = np.random.default_rng(seed)
  if model_name == "gpt":
    text = rng.integers(0, VOCAB, size=(count, SEQUENCE + 1)).astype("int32")
    return text[:, :-1], text[:, 1:]
  x = rng.normal(size=(count, WIDTH)).astype("float32")
  return x, np.tanh(x[:, :4] * 2).astype("float32")


def dataset(x, y, batch=BATCH, static_batch=True):
  """Batches of `batch` rows; with `static_batch=False` their size is
  unknown when the step is traced, as `dataset.batch(n)` makes them."""
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(
      batch, drop_remainder=static_batch)


def step_losses(model, x, y, epochs=2, callbacks=(), static_batch=True):
  """Keras's logged loss after every optimizer step (the running mean of
  the epoch; equal running means mean equal per-step losses), fitting
  with `callbacks` too (`static_batch`: as `dataset`'s)."""
  losses = []

  class Record(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      losses.append(logs["loss"])

  one_device_optimizer.build(model)
  model.fit(dataset(x, y, static_batch=static_batch), epochs=epochs,
            verbose=0,
            callbacks=[Record(), *callbacks])
  return np.array(losses)


def trained_gpt(layout=None, sequence_parallel=False):
  """The GPT (global_clipnorm 0.5) fitted by `step_losses` on one device
  (layout None) or under TensorParallelStrategy(Mesh(layout)), made once
  per process and shared by the tests that check different things of the
  same run: losses, weights, predictions, communication, placement.

  Returns:
    A namespace: strategy (None on one device), model, losses and the
    run's CommunicationLog. Callers must not train or change the model.
  """
  key = tuple(sorted(layout.items())) if layout else None
  return _trained_gpt(key, sequence_parallel)


@functools.cache
def _trained_gpt(layout, sequence_parallel):
  strategy = None if layout is None else tfpar.TensorParallelStrategy(
      tfpar.Mesh(dict(layout)), sequence_parallel=sequence_parallel)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = compile_model(gpt(), global_clipnorm=0.5)
  x, y = data("gpt")
  with tfpar.CommunicationLog() as log:
    losses = step_losses(model, x, y)
  return types.SimpleNamespace(strategy=strategy, model=model, losses=losses,
                               log=log)


def worker_result(strategy, model, predict_count, callbacks=(),
                  static_batch=True):
  """Fits `model` on the GPT data (with `callbacks`; `static_batch`: as
  `dataset`'s), then evaluates and predicts held-out rows: the JSON-ready
  results a worker script writes."""
  x, y = data("gpt")
  losses = step_losses(model, x, y, callbacks=callbacks,
                       static_batch=static_batch)
  px, py = data("gpt", count=predict_count, seed=7)
  return {
      "num_replicas": strategy.num_replicas_in_sync,
      "groups": [list(g) for g in strategy.extended.replica_device_groups],
      "extended": type(strategy.extended).__name__,
      "losses": losses.tolist(),
      "evaluate": model.evaluate(px, py, batch_size=8, verbose=0),
      "predict": model.predict(px, batch_size=8, verbose=0).tolist(),
      "weights": {k: v.tolist()
                  for k, v in tfpar.logical_weights(model).items()},
  }


def assert_trains_like(model, losses, reference, reference_losses,
                       atol=1e-5):
  """Every step's loss and every logical (whole) weight of `model` equal
  `reference`'s to `atol`."""
  np.testing.assert_allclose(losses, reference_losses, atol=atol, rtol=0)
  expected, actual = (tfpar.logical_weights(reference),
                      tfpar.logical_weights(model))
  assert sorted(actual) == sorted(expected)
  for path in expected:
    np.testing.assert_allclose(actual[path], expected[path], atol=atol,
                               rtol=0, err_msg=path)


def assert_same_optimizer_state(model, reference, atol=1e-5):
  """`model`'s optimizer variables (whole, as loaded or restored) equal
  `reference`'s, one for one, to `atol`."""
  assert len(model.optimizer.variables) == len(
      reference.optimizer.variables)
  for got, want in zip(model.optimizer.variables,
                       reference.optimizer.variables):
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=atol,
                               rtol=0, err_msg=want.path)
