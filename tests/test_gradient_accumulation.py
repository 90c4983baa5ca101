"""Keras's `gradient_accumulation_steps` under every tfpar strategy: equal to
one device with the same steps, and gradients cross replicas once per
optimizer step (each micro-step only adds to the replica's own
accumulators), counted at run time with an independent counter on every
collective the optimizer's update launches."""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import collective_count
import precision_common
import stock_strategies
import suite_scope
import tfpar

STEPS_PER_EPOCH, EPOCHS, BATCH = 6, 3, 16
# One Dense pair and a head for the exact float32 checks: every layout (a
# pipeline's two stages, a tensor pair) still applies, and each new strategy
# traces (per device) fewer ops. The mixed_float16 checks keep two pairs:
# how far rounding drifts from one device depends on the model.
BLOCKS, MIXED_BLOCKS = 1, 2


def _chain(blocks=BLOCKS):
  inputs = keras.Input((8,))
  x = inputs
  for b in range(blocks):
    x = keras.layers.Dense(16, activation="tanh", name=f"b{b}_in")(x)
    x = keras.layers.Dense(8, name=f"b{b}_out")(x)
  model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
  rng = np.random.default_rng(7)
  model.set_weights([0.3 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])
  return model


def _data(rows=STEPS_PER_EPOCH * BATCH):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, 8)).astype("float32")
  return x, np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3]], 1)


def _train(strategy, optimizer, callbacks=None, batch_size=BATCH,
           blocks=BLOCKS):
  """`optimizer`: makes the optimizer, in the strategy's scope (Keras's TF
  optimizer keeps the strategy current when it is created); `blocks`: the
  model's Dense pairs."""
  with strategy.scope() if strategy else tf.init_scope():
    model = _chain(blocks)
    model.compile(optimizer=optimizer(), loss="mse")
  history = model.fit(*_data(), batch_size=batch_size, epochs=EPOCHS,
                      shuffle=False, verbose=0, callbacks=callbacks)
  return np.array(history.history["loss"]), model.get_weights()


def _adam(steps=2):
  return lambda: keras.optimizers.Adam(0.01,
                                       gradient_accumulation_steps=steps)


@functools.cache
def _one_device():
  return _train(None, _adam())


def _difference(result, reference):
  """(largest loss difference, largest weight difference)."""
  return precision_common.differences(result[0], result[1], reference[0],
                                      reference[1])[:2]


LAYOUTS = {
    "data 4": lambda: tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4})),
    "data 2 x tensor 2": lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})),
    "data 2 x pipeline 2, 1F1B": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2),
    "data 2 x pipeline 2, GPipe": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=4,
        schedule="gpipe"),
    "pipeline 2 x tensor 2": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2),
}


@functools.cache
def _counted_train(layout, steps):
  """`_train` of Adam accumulating over `steps` under `layout`, and the
  (all-reduces, bytes) its optimizer updates ran, counted through control
  dependencies that leave the losses and weights `_train`'s."""
  with collective_count.update_all_reduces() as totals:
    result = _train(LAYOUTS[layout](), _adam(steps))
  return result, (totals["executions"], totals["bytes"])


# GPipe accumulates as 1F1B does (the same micro-batch steps in another
# order): with TFPAR_TEST_FULL=1.
@pytest.mark.parametrize("layout", suite_scope.cases(
    sorted(set(LAYOUTS) - {"data 2 x pipeline 2, GPipe"}),
    ["data 2 x pipeline 2, GPipe"]))
def test_accumulation_trains_like_one_device(layout):
  loss, weights = _difference(_counted_train(layout, 2)[0], _one_device())
  # Accumulating changes the result (k=2 vs none on one device: 0.13 in the
  # loss), so equality here means the same accumulation happened.
  assert loss < 1e-5 and weights < 1e-5, (layout, loss, weights)


# Stages 1 and 2 with TFPAR_TEST_FULL=1: test_zero accumulates under every
# stage (with clipnorm), and stage 3 here on this model.
@pytest.mark.parametrize("stage", suite_scope.cases([3], [1, 2]))
def test_accumulation_under_zero_trains_like_one_device(stage):
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  loss, weights = _difference(
      _train(strategy, _adam(), callbacks=[tfpar.ZeRO(stage=stage)]),
      _one_device())
  assert loss < 1e-5 and weights < 1e-5, (stage, loss, weights)


def test_accumulating_k_batches_equals_one_k_times_larger_batch():
  # SGD with a mean loss: the mean of k micro-batch gradients is the
  # gradient of their union. The losses Keras reports differ (per micro-
  # batch against per batch), the weights do not.
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  accumulated = _train(strategy, lambda: keras.optimizers.SGD(
      0.1, gradient_accumulation_steps=2))
  larger = _train(None, lambda: keras.optimizers.SGD(0.1),
                  batch_size=2 * BATCH)
  assert max(float(np.abs(a - b).max())
             for a, b in zip(accumulated[1], larger[1])) < 1e-5


@pytest.mark.parametrize("layout", ["data 4", "data 2 x tensor 2",
                                    "data 2 x pipeline 2, 1F1B"])
def test_gradients_cross_replicas_once_per_optimizer_step(layout):
  counts = {steps: _counted_train(layout, steps)[1] for steps in (0, 2)}
  micro_steps = STEPS_PER_EPOCH * EPOCHS
  per_step = {k: (n / (micro_steps // max(k, 1)), b / (micro_steps //
                                                      max(k, 1)))
              for k, (n, b) in counts.items()}
  # The same collectives and bytes per optimizer step, half as many
  # optimizer steps: nothing crosses replicas on an accumulating step.
  assert counts[0][0] > 0 and per_step[2] == per_step[0], (layout, counts)
  if layout == "data 4":  # Every replica sends every gradient once.
    weights = sum(w.size * 4 for w in _chain().get_weights())
    assert per_step[0][1] == 4 * weights, (per_step, weights)
  if layout == "data 2 x tensor 2":
    # Each replica's devices send its split weights' gradients (the
    # pairs' kernels, the column layers' biases) once between them, in one
    # all-reduce per device; the replicated ones (the row layers' biases,
    # the head) go from every device.
    model = _chain()
    size = lambda w: int(np.prod(w.shape)) * 4
    split = sum(size(model.get_layer(f"b{b}_{part}").kernel)
                for b in range(BLOCKS) for part in ("in", "out"))
    split += sum(size(model.get_layer(f"b{b}_in").bias)
                 for b in range(BLOCKS))
    replicated = sum(w.size * 4 for w in model.get_weights()) - split
    assert per_step[0] == (4, 2 * (split + 2 * replicated)), per_step
  print(f"{layout}: per optimizer step {per_step[0][0]:.0f} all-reduces, "
        f"{per_step[0][1]:.0f} bytes (all replicas); accumulation k=2: "
        f"{counts[2][0]} all-reduces over {micro_steps} micro-steps, "
        f"none k=0: {counts[0][0]}")


MIXED_LAYOUTS = {
    "data 4": (LAYOUTS["data 4"], None),
    "pipeline 2 x tensor 2": (LAYOUTS["pipeline 2 x tensor 2"], None),
    **{f"ZeRO-{stage}": (LAYOUTS["data 4"], stage) for stage in (1, 2, 3)},
}


def _mixed_float16_train(strategy, optimizer, callbacks=None):
  """Losses and weights of `_train` under mixed_float16."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    return _train(strategy, optimizer, callbacks, blocks=MIXED_BLOCKS)
  finally:
    keras.mixed_precision.set_global_policy("float32")


@functools.cache
def _mixed_float16_spread():
  """(one device with k=2, loss and weight spread of stock Mirrored on 4
  CPUs vs one device without accumulation), all under mixed_float16.
  (Stock Mirrored cannot accumulate: keras-team/keras#17429.)"""
  reference = _mixed_float16_train(None, _adam())
  spread = _difference(
      _mixed_float16_train(stock_strategies.mirrored(tfpar.Mesh().devices),
                           _adam(0)),
      _mixed_float16_train(None, _adam(0)))
  return reference, spread


@pytest.mark.parametrize("layout", sorted(MIXED_LAYOUTS))
def test_accumulation_with_loss_scaling_trains_like_one_device(layout):
  # Under mixed_float16 Keras wraps the accumulating Adam in a
  # LossScaleOptimizer; its scale and the accumulators must agree.
  make_strategy, stage = MIXED_LAYOUTS[layout]
  reference, (spread_loss, spread_weights) = _mixed_float16_spread()
  callbacks = [tfpar.ZeRO(stage=stage)] if stage else None
  loss, weights = _difference(
      _mixed_float16_train(make_strategy(), _adam(), callbacks), reference)
  print(f"mixed_float16, k=2, {layout}: loss {loss:.1e} weights "
        f"{weights:.1e}; mirrored spread {spread_loss:.1e} / "
        f"{spread_weights:.1e}")
  check = (precision_common.known_fused_half_dense_gap(layout)
           if "tensor" in layout else contextlib.nullcontext())
  with check:
    assert loss <= 2 * spread_loss + 1e-5, (layout, loss, spread_loss)
    assert weights <= 2 * spread_weights + 1e-5, (layout, weights,
                                                  spread_weights)


@pytest.mark.parametrize("steps", [0, 1, -1, 2.5, True])
def test_bad_accumulation_steps_are_value_errors_on_every_path(steps):
  """A recipe, the planner and Keras's own optimizers (which tfpar's
  strategies use unchanged) refuse them before any work, naming the key.
  Keras takes 0 as "off" and, as of Keras 3.15, lets a float such as 2.5
  through to a TypeError in the first step, on one device too: tfpar's
  `fit` hook refuses it first."""
  from tfpar import planner  # pylint: disable=g-import-not-at-top
  from tfpar.recipes import schema  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"training\.gradient_accumulation_"
                     r"steps must be an integer of at least 2"):
    schema.validate({"strategy": {"kind": "data_parallel"},
                     "training": {"gradient_accumulation_steps": steps}},
                    "mine")
  if steps != 1:  # 1 is "no accumulation" for the planner.
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps must "
                       r"be a positive integer"):
      planner.plan(1e6, 4, "16GB", gradient_accumulation_steps=steps)
  if steps in (1, -1, True):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
      keras.optimizers.Adam(gradient_accumulation_steps=steps)
  if steps == 2.5:  # Keras takes it; tfpar's fit refuses it before a step.
    from tfpar import keras_hooks  # pylint: disable=g-import-not-at-top
    keras_hooks.install_fit_preparation()  # As once any strategy is made.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(gradient_accumulation_steps=steps),
                  loss="mse")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps must "
                       r"be an integer.*Received: gradient_accumulation_"
                       r"steps=2.5"):
      model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_an_unknown_policy_is_a_value_error_on_every_path():
  from tfpar import planner  # pylint: disable=g-import-not-at-top
  from tfpar.recipes import schema  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"training\.precision must be one of "
                     r"\['float32', 'mixed_float16', 'mixed_bfloat16'\].*"
                     r"Received: training\.precision='mixed_fp8'"):
    schema.validate({"strategy": {"kind": "data_parallel"},
                     "training": {"precision": "mixed_fp8"}}, "mine")
  with pytest.raises(ValueError, match=r"precision must be one of .*"
                     r"Received: precision='mixed_fp8'"):
    planner.plan(1e6, 4, "16GB", precision="mixed_fp8")
  with pytest.raises(ValueError, match="mixed_fp8"):
    keras.mixed_precision.set_global_policy("mixed_fp8")
  assert keras.mixed_precision.global_policy().name == "float32"
