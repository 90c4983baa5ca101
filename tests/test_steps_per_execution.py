"""`compile(steps_per_execution=N)`: Keras runs N steps per call inside a
`tf.cond` in a `tf.while_loop`, where stock `MirroredStrategy` fails
inside TensorFlow (keras-team/keras#19246: its collectives' call-time
instance keys cannot be fed there). Every tfpar layout runs it in one
process and equals one device, also when an epoch's last batch is
shorter: then a sparse gradient's rows, the tensor groups' activations
and the routed tokens change shape between the calls of one traced step
(`tfpar/_compat/traced_keys.py`). Across workers it is a ValueError before
any work (tests/workers/dp_worker.py, test_multi_worker.py)."""

import contextlib
import faulthandler
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import one_device_optimizer
import tfpar

STEPS = 4
ROWS, BATCH = 100, 16  # 6 batches of 16 and one of 4: loops of 4 and 3.
VOCAB, SEQUENCE, WIDTH = 20, 5, 16


def token_model():
  """Embedding (sparse gradients), an MLP and a head."""
  keras.utils.set_random_seed(5)
  tokens = keras.Input((SEQUENCE,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, WIDTH)(tokens)
  h = keras.layers.Dense(4 * WIDTH, activation="gelu")(x)
  x = keras.layers.Add()([x, keras.layers.Dense(WIDTH)(h)])
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(tokens, keras.layers.Dense(3)(x), name="tokens")


def _data():
  rng = np.random.default_rng(0)
  x = rng.integers(0, VOCAB, (ROWS, SEQUENCE)).astype("int32")
  return x, rng.normal(size=(ROWS, 3)).astype("float32")


def _runs(strategy, steps, callbacks=None, evaluate=True):
  """(losses, weights, evaluate, predict) after an epoch."""
  with strategy.scope() if strategy else tf.init_scope():
    model = token_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  metrics=["mae"], steps_per_execution=steps)
  if strategy is None:
    one_device_optimizer.build(model)
  x, y = _data()
  losses = model.fit(x, y, batch_size=BATCH, shuffle=False,
                     verbose=0, callbacks=callbacks).history["loss"]
  if not evaluate:
    return losses, model.get_weights()
  return (losses, model.get_weights(),
          model.evaluate(x, y, batch_size=BATCH, verbose=0),
          model.predict(x, batch_size=BATCH, verbose=0))


@functools.cache
def _one_device():
  return _runs(None, 1)


def _assert_same(got, want, atol=1e-6):
  np.testing.assert_allclose(got[0], want[0], atol=atol)
  assert len(got[1]) == len(want[1])
  for a, b in zip(got[1], want[1]):
    np.testing.assert_allclose(a, b, atol=atol)
  for a, b in zip(got[2:], want[2:]):  # evaluate, predict
    np.testing.assert_allclose(a, b, atol=atol)


# ZeRO-1 changes only the update: its evaluate and predict are data 4's.
LAYOUTS = {
    "data4": lambda: (tfpar.DataParallelStrategy(), None),
    "data4_zero1_callback": lambda: (tfpar.DataParallelStrategy(),
                                     [tfpar.ZeRO(stage=1)]),
    "data4_zero3": lambda: (tfpar.DataParallelStrategy(
        zero=tfpar.ZeRO(stage=3)), None),
    "data2_tensor2": lambda: (tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})), None),
    "data2_pipeline2": lambda: (tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2), None),
    "pipeline2_tensor2": lambda: (tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2),
                                  None),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_loops_like_one_device(layout):
  strategy, callbacks = LAYOUTS[layout]()
  got = _runs(strategy, STEPS, callbacks,
              evaluate=layout != "data4_zero1_callback")
  _assert_same(got, _one_device())


def moe_model():
  """A token model through a `tfpar.MoE` block (no load-balancing loss:
  under a pipeline it is a micro-batch statistic,
  docs/expert_parallel.md)."""
  keras.utils.set_random_seed(2)
  tokens = keras.Input((SEQUENCE,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, WIDTH)(tokens)
  x = keras.layers.Dense(WIDTH, activation="relu")(x)
  x = keras.layers.Add()([x, tfpar.MoE(4, 2 * WIDTH,
                                       aux_loss_coefficient=0.0)(x)])
  return keras.Model(tokens, keras.layers.Dense(VOCAB)(x), name="moe")


def _moe_runs(strategy, steps):
  """An epoch of next-token prediction: 52 rows in batches of 8, the last
  of 4. (The sparse cross-entropy's shape `Assert`s are what hung.)"""
  with strategy.scope() if strategy else tf.init_scope():
    model = moe_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), steps_per_execution=steps)
  ids = np.random.default_rng(1).integers(
      0, VOCAB, (52, SEQUENCE + 1)).astype("int32")
  x, y = ids[:, :-1], ids[:, 1:]
  history = model.fit(x, y, batch_size=8, shuffle=False,
                      verbose=0).history["loss"]
  return (history, model.get_weights(),
          model.evaluate(x, y, batch_size=8, verbose=0),
          model.predict(x, batch_size=8, verbose=0))


@contextlib.contextmanager
def _bounded(seconds=300):
  """Ends the test process, printing every thread's stack, if the body
  runs longer than `seconds` (a hang, as expert x pipeline's was, would
  stall the suite; this body takes about 10 s)."""
  faulthandler.dump_traceback_later(seconds, exit=True)
  try:
    yield
  finally:
    faulthandler.cancel_dump_traceback_later()


EXPERT_LAYOUTS = {
    "data4_expert2": lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": 4}), expert=2),
    "data2_tensor2_expert2": lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2}), expert=2),
    "data2_pipeline2_expert2": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2,
        expert=2),
}


@pytest.mark.parametrize("layout", sorted(EXPERT_LAYOUTS))
def test_expert_layouts_loop_like_one_device(layout):
  """Routed tokens cross the expert group in all-to-alls."""
  with _bounded():
    got = _moe_runs(EXPERT_LAYOUTS[layout](), STEPS)
  _assert_same(got, _moe_one_device())


@functools.cache
def _moe_one_device():
  return _moe_runs(None, 1)


def test_expert_pipeline_steps_through_a_short_last_batch():
  """Without the loop too: the shorter last batch makes Keras trace the
  step again with the batch size left open, where expert x pipeline hung
  in its first step (TensorFlow's function-wide chain of `Assert`s ran
  across the replicas' all-to-alls; tfpar/_compat/side_effects.py)."""
  with _bounded():
    got = _moe_runs(EXPERT_LAYOUTS["data2_pipeline2_expert2"](), 1)
  _assert_same(got, _moe_one_device())


def test_loss_scaling_loops_as_it_steps():
  """Under `mixed_float16` Keras's `LossScaleOptimizer` decides each
  update in the loop as in single steps (stock strategies cannot loop,
  so the reference is the same layout stepping)."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    looped = _runs(tfpar.DataParallelStrategy(), STEPS, evaluate=False)
    stepped = _runs(tfpar.DataParallelStrategy(), 1, evaluate=False)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  _assert_same(looped, stepped)
