"""tfpar.BackupAndRestore resumes at the exact batch, from backups every N
batches and from the backup SIGTERM makes: after one or two interruptions
the weights and optimizer state are those of an uninterrupted run."""

import json
import os
import signal

import keras
import numpy as np
import pytest

import dp_common
import suite_scope
import tfpar
from zero_common import data_parallel

EPOCHS = 3


class _Interrupt(keras.callbacks.Callback):
  """Raises before batch `batch` of epoch `epoch`, as a crash would."""

  def __init__(self, epoch, batch):
    super().__init__()
    self.epoch, self.batch = epoch, batch

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if (self._epoch, batch) == (self.epoch, self.batch):
      raise RuntimeError("interrupted")


def _fit(model, callbacks):
  x, y = dp_common.make_data()
  return dp_common.fit(model, x, y, epochs=EPOCHS, callbacks=callbacks)


def _state(model, path):
  """Weights and optimizer variables, whole, as one device loads them."""
  model.save_weights(path)
  plain = dp_common.build_model(seed=5)
  plain.optimizer.build(plain.trainable_variables)
  plain.load_weights(path)
  return plain.get_weights() + [v.numpy() for v in plain.optimizer.variables]


# Under ZeRO-3 with TFPAR_TEST_FULL=1: test_multi_worker resumes a killed
# ZeRO-3 worker from its backup.
@pytest.mark.parametrize("zero_stage", suite_scope.cases([None], [3]))
def test_step_backups_resume_at_the_exact_batch(tmp_path, zero_stage):
  zero = lambda: [tfpar.ZeRO(stage=zero_stage)] if zero_stage else []
  with data_parallel().scope():
    uninterrupted = dp_common.build_model()
  _fit(uninterrupted, zero())

  backup_dir = str(tmp_path / "backup")
  backup = lambda: tfpar.BackupAndRestore(backup_dir, save_freq=3)
  metadata = os.path.join(backup_dir, "training_metadata.json")
  # Two interruptions: epoch 1 before batch 5 (last backup after batch 3),
  # then, resumed, epoch 2 before batch 4 (backups after batch 4 and 7 of
  # epoch 1, counted from the resumed batch, then after batch 2).
  # The first run starts from the same weights; the restarts do not.
  for seed, stop, (epoch, done) in ((1, (1, 5), (1, 4)),
                                    (7, (2, 4), (2, 3))):
    with data_parallel().scope():
      model = dp_common.build_model(seed=seed)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="interrupted"):
      _fit(model, zero() + [backup(), _Interrupt(*stop)])
    # Keras skipped on_train_end; SIGTERM is given back all the same.
    assert signal.getsignal(signal.SIGTERM) is handler
    with open(metadata) as f:
      recorded = json.load(f)
    assert (recorded["epoch"], recorded["tfpar_batches_done"]) == (epoch, done)

  with data_parallel().scope():
    resumed = dp_common.build_model(seed=7)
  history = _fit(resumed, zero() + [backup()])
  assert len(history["loss"]) == 1  # Only the rest of the third epoch.
  assert int(resumed.optimizer.iterations.numpy()) == (
      EPOCHS * dp_common.STEPS_PER_EPOCH)
  for got, want in zip(_state(resumed, str(tmp_path / "a.weights.h5")),
                       _state(uninterrupted, str(tmp_path / "b.weights.h5"))):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  assert not os.path.exists(backup_dir)  # Removed once training ended.


class _Preempt(keras.callbacks.Callback):
  """Sends SIGTERM to this process before batch 5 of epoch 1."""

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if (self._epoch, batch) == (1, 5):
      os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_backs_up_the_step_and_exits_143(tmp_path):
  with data_parallel().scope():
    uninterrupted = dp_common.build_model()
  _fit(uninterrupted, [])
  backup_dir = str(tmp_path / "backup")
  with data_parallel().scope():
    model = dp_common.build_model()
  handler = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as exited:
    _fit(model, [tfpar.BackupAndRestore(backup_dir), _Preempt()])
  assert exited.value.code == tfpar.preemption.PREEMPTED_EXIT_CODE == 143
  assert signal.getsignal(signal.SIGTERM) is handler  # Given back.
  with open(os.path.join(backup_dir, "training_metadata.json")) as f:
    recorded = json.load(f)
  assert (recorded["epoch"], recorded["tfpar_batches_done"]) == (1, 6)

  with data_parallel().scope():
    resumed = dp_common.build_model(seed=7)
  _fit(resumed, [tfpar.BackupAndRestore(backup_dir)])
  for got, want in zip(_state(resumed, str(tmp_path / "a.weights.h5")),
                       _state(uninterrupted, str(tmp_path / "b.weights.h5"))):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
