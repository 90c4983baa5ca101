"""Mixed precision: the pipeline scales the loss by the LossScaleOptimizer's
dynamic scale, as Keras's own train_step does; ZeRO-3 gathers weights in the
compute dtype. Each against one device, within the spread of stock
MirroredStrategy vs one device measured side by side."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import precision_common
import stock_strategies
import tfpar


@pytest.fixture
def mixed_float16():
  with precision_common.global_policy("mixed_float16"):
    yield


def _chain():
  inputs = keras.Input((8,))
  x = inputs
  for b in range(4):
    x = keras.layers.Dense(16, activation="tanh", name=f"b{b}_in")(x)
    x = keras.layers.Dense(8, name=f"b{b}_out")(x)
  model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32",
                                                 name="head")(x))
  rng = np.random.default_rng(7)
  model.set_weights([0.3 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])
  return model


def _data_two_cpus():
  return tfpar.DataParallelStrategy(
      tfpar.Mesh({"data": 2}, devices=tfpar.Mesh().devices[:2]))


def _train(strategy, callbacks=None):
  with strategy.scope() if strategy else tf.init_scope():
    model = _chain()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(96, 8)).astype("float32")
  y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3]], 1)
  history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False,
                      verbose=0, callbacks=callbacks)
  scale = getattr(model.optimizer, "dynamic_scale", None)  # mixed_float16
  return (np.array(history.history["loss"]), model.get_weights(),
          None if scale is None else float(scale.numpy()))


@functools.cache
def _one_device_and_mirrored(policy):
  """`_train` under `policy` on one device and under stock Mirrored on 2
  CPUs: the reference and the spread each mixed-policy test is held to."""
  with precision_common.global_policy(policy):
    return _train(None), _train(stock_strategies.mirrored(["/cpu:0",
                                                           "/cpu:1"]))


def _difference(result, reference):
  """(largest loss difference, largest weight difference)."""
  return precision_common.differences(result[0], result[1], reference[0],
                                      reference[1])[:2]


def test_mixed_float16_pipeline_within_the_spread_of_mirrored(mixed_float16):
  del mixed_float16
  reference, mirrored = _one_device_and_mirrored("mixed_float16")
  pipeline = _train(tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2))
  spread_loss, spread_weights = _difference(mirrored, reference)
  loss, weights = _difference(pipeline, reference)
  # Measured: mirrored 7.9e-5 / 2.1e-4, pipeline 8.6e-5 / 2.7e-4 (losses /
  # weights); scaling by the constant loss_scale_factor instead gave 0.16.
  assert loss <= 2 * spread_loss + 1e-5, (loss, spread_loss)
  assert weights <= 2 * spread_weights + 1e-5, (weights, spread_weights)
  assert pipeline[2] is not None  # Keras compiled a LossScaleOptimizer.
  assert pipeline[2] == reference[2] == mirrored[2]


def test_zero3_gathers_bfloat16_and_trains_like_mirrored():
  reference, mirrored = _one_device_and_mirrored("mixed_bfloat16")
  with precision_common.global_policy("mixed_bfloat16"):
    strategy = _data_two_cpus()
    with tfpar.CommunicationLog() as log:
      zero = _train(strategy, callbacks=[tfpar.ZeRO(stage=3)])
  spread_loss, spread_weights = _difference(mirrored, reference)
  loss, weights = _difference(zero, reference)
  assert loss <= 2 * spread_loss + 1e-5, (loss, spread_loss)
  assert weights <= 2 * spread_weights + 1e-5, (weights, spread_weights)
  # Each replica sends its half of every weight once per forward pass, in
  # its layer's compute dtype: 2 bytes per element, 4 for the float32 head.
  sent = sum(r.bytes for r in log.step_records()
             if r.kind == "all-gather" and r.phase == "forward")
  expected = sum(-(-int(np.prod(w.shape)) // 2) *
                 (4 if layer.name == "head" else 2)
                 for layer in _chain().layers for w in layer.weights)
  assert sent == expected, (sent, expected)
  print(f"bfloat16 ZeRO-3: loss {loss:.1e} weights {weights:.1e}; "
        f"mirrored {spread_loss:.1e} / {spread_weights:.1e}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_loss_scaling_trains_like_mirrored(mixed_float16, stage):
  del mixed_float16
  reference, mirrored = _one_device_and_mirrored("mixed_float16")
  zero = _train(_data_two_cpus(), callbacks=[tfpar.ZeRO(stage=stage)])
  spread_loss, spread_weights = _difference(mirrored, reference)
  loss, weights = _difference(zero, reference)
  assert loss <= 2 * spread_loss + 1e-5, (loss, spread_loss)
  assert weights <= 2 * spread_weights + 1e-5, (weights, spread_weights)
  assert zero[2] == reference[2]  # The same dynamic loss scale.
  print(f"mixed_float16 ZeRO-{stage}: loss {loss:.1e} weights "
        f"{weights:.1e}; mirrored {spread_loss:.1e} / {spread_weights:.1e}")


OVERFLOW_LAYOUTS = {
    "one device": (lambda: None, None),
    "data 2": (_data_two_cpus, None),
    "data 2 x pipeline 2": (lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2), None),
    "ZeRO-2": (_data_two_cpus, 2),
    "ZeRO-3": (_data_two_cpus, 3),
}


@functools.cache
def _overflowed(layout):
  """The model after two steps under mixed_float16 on an OVERFLOW_LAYOUTS
  layout: in the first, only the rows of data replica 1 overflow in
  float16."""
  make_strategy, stage = OVERFLOW_LAYOUTS[layout]
  strategy = make_strategy()
  with precision_common.global_policy("mixed_float16"):
    with strategy.scope() if strategy else tf.init_scope():
      model = _chain()
      model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    x[8:16] *= 3e4  # Second half of the first batch: replica 1's rows.
    model.fit(x, np.ones((32, 3), "float32"), batch_size=16, epochs=1,
              shuffle=False, verbose=0,
              callbacks=[tfpar.ZeRO(stage=stage)] if stage else None)
  return model


def test_a_step_that_overflows_on_one_replica_is_skipped_on_all():
  reference = _overflowed("one device")
  scale = float(reference.optimizer.dynamic_scale.numpy())
  # One device sees the overflow: it halves the scale and skips the step.
  # (Stock MirroredStrategy, measured: replica 0 decides, it applies the
  # step and the weights become NaN.)
  assert scale == 2.0 ** 14, scale
  for layout in ("data 2", "data 2 x pipeline 2", "ZeRO-2", "ZeRO-3"):
    model = _overflowed(layout)
    weights = model.get_weights()
    assert float(model.optimizer.dynamic_scale.numpy()) == scale, layout
    assert all(np.isfinite(w).all() for w in weights), layout
    assert max(float(np.abs(a - b).max())
               for a, b in zip(weights, reference.get_weights())) < 1e-3


def test_zero_checkpoint_keeps_the_loss_scale(mixed_float16, tmp_path):
  del mixed_float16
  path = str(tmp_path / "zero.weights.h5")
  _overflowed("ZeRO-2").save_weights(path)
  restored = _chain()
  restored.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  restored.optimizer.build(restored.trainable_variables)
  restored.load_weights(path)
  assert float(restored.optimizer.dynamic_scale.numpy()) == 2.0 ** 14
  assert int(restored.optimizer.iterations.numpy()) == 1
  wanted = _overflowed("one device").optimizer.variables
  got = restored.optimizer.variables
  assert [v.shape for v in got] == [v.shape for v in wanted]
  for a, b in zip(got, wanted):  # Whole Adam moments, as on one device.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3,
                               err_msg=a.path)


def test_zero_refuses_half_precision_weights_before_training():
  with precision_common.global_policy("float16"):
    strategy = _data_two_cpus()
    with pytest.raises(ValueError, match=r"tfpar.ZeRO shards float32 "
                       r"weights.*b0_in/kernel.*float16"):
      _train(strategy, callbacks=[tfpar.ZeRO(stage=3)])


def test_float16_and_float32_weights_reduce_in_groups_of_one_dtype():
  """Stock MirroredStrategy fails on this model ("Tensors in list passed to
  'values' of 'ConcatV2' Op have types [float32, ..., float16]"): it packs
  gradients of both dtypes into one tensor."""
  def run(strategy):
    with strategy.scope() if strategy else tf.init_scope():
      inputs = keras.Input((8,))
      x = keras.layers.Dense(16, activation="tanh", dtype="float16")(inputs)
      model = keras.Model(inputs, keras.layers.Dense(3)(x))
      rng = np.random.default_rng(7)
      model.set_weights([0.3 * rng.normal(size=w.shape)
                         for w in model.get_weights()])
      model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    model.fit(x, x[:, :3], batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()
  reference = run(None)
  result = run(_data_two_cpus())
  assert [w.dtype for w in result] == [w.dtype for w in reference]
  for got, want in zip(result, reference):
    # float16 rounding (and float16 inputs of the float32 layer).
    tolerance = 2e-3 if want.dtype == np.float16 else 1e-4
    np.testing.assert_allclose(got, want, atol=tolerance)


def _growing_scale_run(strategy, callbacks=None):
  """Six steps with a loss scale that doubles every 2 finite steps."""
  with strategy.scope() if strategy else tf.init_scope():
    model = _chain()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), dynamic_growth_steps=2), loss="mse")
  x = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
  model.fit(x, x[:, :3], batch_size=16, epochs=1, shuffle=False, verbose=0,
            callbacks=callbacks)
  return model.get_weights(), float(model.optimizer.dynamic_scale.numpy())


def test_the_loss_scale_grows_as_on_one_device(mixed_float16):
  del mixed_float16
  reference = _growing_scale_run(None)
  assert reference[1] == 2.0 ** 15 * 2 ** 3  # 6 finite steps.
  for strategy, callbacks in (
      (_data_two_cpus(), None),
      (tfpar.PipelineParallelStrategy(tfpar.Mesh({"data": 2, "pipeline": 2}),
                                      num_microbatches=2), None),
      (_data_two_cpus(), [tfpar.ZeRO(stage=2)])):
    weights, scale = _growing_scale_run(strategy, callbacks)
    assert scale == reference[1]
    assert max(float(np.abs(a - b).max())
               for a, b in zip(weights, reference[0])) < 1e-3


def test_describe_names_the_policy_and_the_accumulation(mixed_float16):
  tensor = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2, "tensor": 2}))
  pipeline = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2)
  expected = ("training: policy float32, mixed_float16 (variables float32, "
              "compute float16); dynamic loss scaling; gradient accumulation "
              "over 4 steps")  # float32: the head's own policy.
  for strategy in (tensor, pipeline):
    with strategy.scope():
      model = _chain()
      model.compile(keras.optimizers.Adam(gradient_accumulation_steps=4),
                    "mse")
    assert strategy.describe(model, print_fn=None).splitlines()[-1] == (
        expected)
    plan_text = tfpar.ShardingPlan().describe(model, strategy,
                                              print_fn=None)
    assert plan_text.splitlines()[-1] == expected
  assert pipeline.describe_stages(model, print_fn=None).splitlines()[-1] == (
      expected)
