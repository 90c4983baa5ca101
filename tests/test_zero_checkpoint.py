"""Checkpoints of a tfpar.ZeRO run hold the whole optimizer state: they
resume over another replica count, or without ZeRO, with the losses the
run would have had."""

import functools
import types

import h5py
import keras
import numpy as np
import pytest

import dp_common
import tfpar
from zero_common import data_parallel
from zero_common import model_under

STAGES = (1, 2, 3)


def _adam():
  return keras.optimizers.Adam(0.01, global_clipnorm=1.0)


def _two_replicas():
  return tfpar.DataParallelStrategy(
      tfpar.Mesh({"data": 2}, tfpar.Mesh().devices[:2]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """stage -> a ZeRO run (made once, shared by the tests that check
  different things of it): the model fitted one epoch, saved to `path`,
  then 2 more epochs, whose losses are `expected`."""
  @functools.cache
  def run(stage):
    x, y = dp_common.make_data()
    model = model_under(_adam, data_parallel())
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=stage)])
    path = str(tmp_path_factory.mktemp(f"zero{stage}") / "zero.weights.h5")
    model.save_weights(path)
    expected = dp_common.fit(model, x, y, epochs=2)["loss"]
    return types.SimpleNamespace(model=model, path=path, expected=expected)
  return run


@pytest.mark.parametrize("target", ["zero_on_2_replicas", "no_strategy"])
@pytest.mark.parametrize("stage", STAGES)
def test_save_weights_resumes_elsewhere(stage, target, saved):
  x, y = dp_common.make_data()
  path, expected = saved(stage).path, saved(stage).expected

  if target == "no_strategy":
    resumed, callbacks = model_under(_adam, seed=9), []
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
  else:
    # The optimizer is sharded (and built) as fit starts; load weights and
    # state then, as BackupAndRestore does.
    resumed = model_under(_adam, _two_replicas(), seed=9)

    class Load(keras.callbacks.Callback):

      def on_train_begin(self, logs=None):
        self.model.optimizer.build(self.model.trainable_variables)
        self.model.load_weights(path)
    callbacks = [tfpar.ZeRO(stage=stage), Load()]
  losses = dp_common.fit(resumed, x, y, epochs=2, callbacks=callbacks)
  np.testing.assert_allclose(losses["loss"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_load_from_resumes_one_device_state_under_zero(stage, tmp_path):
  """Weights and Adam's state saved on one device continue under ZeRO over
  4 replicas with the losses one device goes on to have."""
  x, y = dp_common.make_data()
  plain = model_under(_adam)
  dp_common.fit(plain, x, y, epochs=1)
  path = tmp_path / "plain.weights.h5"
  plain.save_weights(str(path))
  expected = dp_common.fit(plain, x, y, epochs=2)["loss"]
  resumed = model_under(_adam, data_parallel(), seed=9)
  losses = dp_common.fit(resumed, x, y, epochs=2, callbacks=[
      tfpar.ZeRO(stage=stage, load_from=path)])
  np.testing.assert_allclose(losses["loss"], expected, atol=1e-5, rtol=0)


def test_checkpoint_lists_what_an_unsharded_optimizer_saves(tmp_path, saved):
  x, y = dp_common.make_data()
  plain = model_under(_adam)
  dp_common.fit(plain, x, y, epochs=1)
  plain.save_weights(str(tmp_path / "plain.weights.h5"))
  model = saved(3).model  # ZeRO-3, its weights saved after one epoch.

  def shapes(path):
    found = {}
    with h5py.File(path) as f:
      f.visititems(lambda key, item: found.setdefault(key, item.shape)
                   if isinstance(item, h5py.Dataset) else None)
    return found
  assert shapes(saved(3).path) == shapes(tmp_path / "plain.weights.h5")
  # A whole .keras file loads as a plain model with a plain Adam.
  model.save(str(tmp_path / "zero.keras"))
  loaded = keras.models.load_model(str(tmp_path / "zero.keras"))
  assert type(loaded.optimizer) is keras.optimizers.Adam
  np.testing.assert_allclose(loaded.predict(x[:64], verbose=0),
                             model.predict(x[:64], verbose=0), atol=1e-6)


class _StopAtEpoch(keras.callbacks.Callback):

  def __init__(self, epoch):
    super().__init__()
    self.epoch = epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self.epoch:
      raise RuntimeError("interrupted")


def test_model_checkpoint_and_backup_and_restore(tmp_path):
  x, y = dp_common.make_data()
  full = model_under(_adam, data_parallel())
  expected = dp_common.fit(full, x, y, callbacks=[tfpar.ZeRO(stage=2)])

  backup = str(tmp_path / "backup")
  pattern = str(tmp_path / "e{epoch}.weights.h5")
  interrupted = model_under(_adam, data_parallel())
  with pytest.raises(RuntimeError, match="interrupted"):
    dp_common.fit(interrupted, x, y, callbacks=[
        tfpar.ZeRO(stage=2), keras.callbacks.BackupAndRestore(backup),
        keras.callbacks.ModelCheckpoint(pattern, save_weights_only=True),
        _StopAtEpoch(2)])
  resumed = model_under(_adam, data_parallel(), seed=9)
  history = dp_common.fit(resumed, x, y, callbacks=[
      tfpar.ZeRO(stage=2), keras.callbacks.BackupAndRestore(backup)])
  np.testing.assert_allclose(history["loss"], expected["loss"][2:],
                             atol=1e-5, rtol=0)
  for got, want in zip(resumed.get_weights(), full.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

  # The epoch-2 ModelCheckpoint file continues without ZeRO the same way.
  plain = model_under(_adam, seed=9)
  plain.optimizer.build(plain.trainable_variables)
  plain.load_weights(str(tmp_path / "e2.weights.h5"))
  np.testing.assert_allclose(
      dp_common.fit(plain, x, y, epochs=1)["loss"], expected["loss"][2:],
      atol=1e-5, rtol=0)
