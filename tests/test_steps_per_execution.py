"""`compile(steps_per_execution=N)`: Keras runs N steps per call inside a
`tf.cond` in a `tf.while_loop`. Where a tfpar strategy's steps run there
they equal one device (also when the batches are not a multiple of N);
where they would fail inside TensorFlow (a replica's `merge_call` in the
loop, as under stock `MirroredStrategy`: keras-team/keras#19246) the run
is a ValueError before any work."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import pp_common
import tfpar

STEPS = 4  # 96 rows in batches of 16: 6 batches, so a short last loop.


def _model(strategy, steps):
  with strategy.scope() if strategy else tf.init_scope():
    model = pp_common.residual_chain(blocks=2)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  metrics=["mae"], steps_per_execution=steps)
  return model


def _runs(model, fit=True, callbacks=None):
  x, y, sw = pp_common.data()
  losses = None
  if fit:
    losses = model.fit(x, y, sample_weight=sw, batch_size=16, epochs=3,
                       shuffle=False, verbose=0,
                       callbacks=callbacks).history["loss"]
  return (losses, model.get_weights(),
          model.evaluate(x, y, batch_size=16, verbose=0),
          model.predict(x, batch_size=16, verbose=0))


@functools.cache
def _one_device(fit=True):
  return _runs(_model(None, 1), fit)


def _assert_same(got, want):
  if want[0] is not None:
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
  for a, b in zip(got[1], want[1]):
    np.testing.assert_allclose(a, b, atol=1e-6)
  np.testing.assert_allclose(got[2], want[2], atol=1e-6)
  np.testing.assert_allclose(got[3], want[3], atol=1e-6)


@pytest.mark.parametrize("zero", ["callback_stage1", "option_stage3"])
def test_zero_trains_in_the_loop_like_one_device(zero):
  if zero == "option_stage3":
    strategy = tfpar.DataParallelStrategy(zero=tfpar.ZeRO(stage=3))
    callbacks = None
  else:
    strategy = tfpar.DataParallelStrategy()
    callbacks = [tfpar.ZeRO(stage=1)]
  model = _model(strategy, STEPS)
  _assert_same(_runs(model, callbacks=callbacks), _one_device())


@pytest.mark.parametrize("layout", ["data4", "data2_pipeline2"])
def test_evaluate_and_predict_in_the_loop_like_one_device(layout):
  strategy = (tfpar.DataParallelStrategy() if layout == "data4" else
              tfpar.PipelineParallelStrategy(
                  tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2))
  _assert_same(_runs(_model(strategy, STEPS), fit=False),
               _one_device(fit=False))


REFUSED = {
    "data4": (lambda: tfpar.DataParallelStrategy(), ["fit"]),
    "tensor4": (lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"tensor": 4})), ["fit", "evaluate", "predict"]),
    "data2_pipeline2": (lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2),
                        ["fit"]),
}


@pytest.mark.parametrize("layout", sorted(REFUSED))
def test_what_cannot_loop_is_refused_before_any_work(layout):
  make, runs = REFUSED[layout]
  strategy = make()
  model = _model(strategy, STEPS)
  x, y, _ = pp_common.data()
  for run in runs:
    distributed = strategy.extended.datasets_distributed
    with pytest.raises(ValueError, match=(
        rf"cannot run {run} with steps_per_execution > 1.*Received: "
        rf"steps_per_execution={STEPS}")):
      if run == "predict":
        model.predict(x, batch_size=16, verbose=0)
      else:
        getattr(model, run)(x, y, batch_size=16, verbose=0)
    assert strategy.extended.datasets_distributed == distributed
  assert not model.optimizer.built
