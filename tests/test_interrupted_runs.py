"""The input iterators of a `fit` that raised are freed on the calling
thread before the next run starts, not left to Python's collector (which
could free them inside a replica thread tracing the next step, where
TensorFlow's multi-device iterator stalled the trace for minutes)."""

import gc

import keras
import pytest

import dp_common
from zero_common import data_parallel


class _Interrupt(keras.callbacks.Callback):

  def on_train_batch_begin(self, batch, logs=None):
    if batch == 2:
      raise RuntimeError("interrupted")


def _epoch_iterators():
  return [o for o in gc.get_objects()
          if type(o).__name__ == "TFEpochIterator"]


class _CountIterators(keras.callbacks.Callback):
  """Records how many Keras epoch iterators are alive as the run begins
  (the run's own is one)."""

  def on_train_begin(self, logs=None):
    self.alive = len(_epoch_iterators())

  on_test_begin = on_train_begin


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_the_next_run_frees_the_interrupted_runs_iterators(method):
  with data_parallel().scope():
    model = dp_common.build_model()
  x, y = dp_common.make_data()
  gc.collect()
  gc.disable()  # Only tfpar may collect the interrupted run's garbage.
  try:
    with pytest.raises(RuntimeError, match="interrupted"):
      model.fit(x, y, batch_size=dp_common.GLOBAL_BATCH,
                callbacks=[_Interrupt()], verbose=0)
    assert len(_epoch_iterators()) == 1  # In the exception's cycle.
    counter = _CountIterators()
    kwargs = {"epochs": 1} if method == "fit" else {}
    getattr(model, method)(x, y, batch_size=dp_common.GLOBAL_BATCH,
                           callbacks=[counter], verbose=0, **kwargs)
    assert counter.alive == 1
  finally:
    gc.enable()
