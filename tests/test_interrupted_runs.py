"""The input iterators of a `fit` that raised are freed on the calling
thread before the next run starts, not left to Python's collector (which
could free them inside a replica thread tracing the next step, where
destroying TensorFlow's multi-device iterator stalled the trace for
minutes): under tfpar's strategies, and under a stock MirroredStrategy
when `tfpar.BackupAndRestore` resumes the interrupted fit."""

import gc
import weakref

import keras
import pytest
import tensorflow as tf

import tfpar
from tfpar import keras_hooks
import dp_common
import stock_strategies
from keras.src.backend.tensorflow import trainer as tf_trainer
from zero_common import data_parallel


class _Interrupt(keras.callbacks.Callback):

  def on_train_batch_begin(self, batch, logs=None):
    if batch == 2:
      raise RuntimeError("interrupted")


@pytest.fixture
def alive_epoch_iterators(monkeypatch):
  """How many of the Keras epoch iterators made since are alive."""
  made = []
  init = tf_trainer.TFEpochIterator.__init__

  def recording_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(weakref.ref(self))
  monkeypatch.setattr(tf_trainer.TFEpochIterator, "__init__", recording_init)
  return lambda: sum(ref() is not None for ref in made)


class _CountIterators(keras.callbacks.Callback):
  """Records how many epoch iterators are alive as the run begins (the
  run's own is one)."""

  def __init__(self, count):
    super().__init__()
    self.count = count

  def on_train_begin(self, logs=None):
    self.alive = self.count()

  on_test_begin = on_train_begin


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_the_next_run_frees_the_interrupted_runs_iterators(
    method, alive_epoch_iterators):
  with data_parallel().scope():
    model = dp_common.build_model()
  x, y = dp_common.make_data()
  gc.disable()  # Only tfpar may collect the interrupted run's garbage.
  try:
    with pytest.raises(RuntimeError, match="interrupted"):
      model.fit(x, y, batch_size=dp_common.GLOBAL_BATCH,
                callbacks=[_Interrupt()], verbose=0)
    assert alive_epoch_iterators() == 1  # In the exception's cycles.
    counter = _CountIterators(alive_epoch_iterators)
    kwargs = {"epochs": 1} if method == "fit" else {}
    getattr(model, method)(x, y, batch_size=dp_common.GLOBAL_BATCH,
                           callbacks=[counter], verbose=0, **kwargs)
    assert counter.alive == 1
  finally:
    gc.enable()


def test_backup_and_restore_collects_under_a_stock_strategy(
    alive_epoch_iterators, tmp_path):
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
  with stock_strategies.mirrored(devices).scope():
    model = dp_common.build_model()
  x, y = dp_common.make_data()
  backup_dir = str(tmp_path / "backup")
  gc.disable()  # Only tfpar may collect the interrupted run's garbage.
  try:
    with pytest.raises(RuntimeError, match="interrupted"):
      model.fit(x, y, batch_size=dp_common.GLOBAL_BATCH, shuffle=False,
                callbacks=[tfpar.BackupAndRestore(backup_dir, save_freq=1),
                           _Interrupt()], verbose=0)
    assert alive_epoch_iterators() == 1  # In the exception's cycles.
    counter = _CountIterators(alive_epoch_iterators)
    model.fit(x, y, batch_size=dp_common.GLOBAL_BATCH, shuffle=False,
              callbacks=[tfpar.BackupAndRestore(backup_dir, save_freq=1),
                         counter], verbose=0)
    assert counter.alive == 1
  finally:
    gc.enable()


def test_backup_and_restore_installs_the_run_hooks(monkeypatch, tmp_path):
  installed = []
  monkeypatch.setattr(keras_hooks, "install_run_hooks",
                      lambda: installed.append(True))
  tfpar.BackupAndRestore(str(tmp_path / "backup"))
  assert installed
