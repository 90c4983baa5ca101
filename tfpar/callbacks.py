"""Keras checkpoint callbacks that are safe with several workers.

Stock Keras 3 callbacks make every worker write the same files at the same
moment. These subclasses let the chief alone write, while every worker reads
the chief's files, which is TF's multi-worker convention (the checkpoint
directory is on storage all workers can read). On one process they behave
exactly like the Keras callbacks.
"""

import keras
import tensorflow as tf


def is_chief(model):
  """Whether this process should write checkpoints for `model`."""
  strategy = model.distribute_strategy
  return getattr(strategy.extended, "should_checkpoint", True)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
  """`keras.callbacks.ModelCheckpoint` that only the chief writes.

  Args: as `keras.callbacks.ModelCheckpoint`.

  Example:

  >>> import tfpar
  >>> checkpoint = tfpar.ModelCheckpoint("/tmp/ckpt/{epoch}.weights.h5",
  ...                                    save_weights_only=True)
  """

  def _save_model(self, epoch, batch, logs):
    if is_chief(self.model):
      super()._save_model(epoch, batch, logs)


class BackupAndRestore(keras.callbacks.BackupAndRestore):
  """`keras.callbacks.BackupAndRestore` for multi-worker jobs.

  The chief writes the backup; every worker restores from it, so all
  workers resume at the same epoch with the same weights and optimizer
  state after a worker was killed and the job restarted.

  Args: as `keras.callbacks.BackupAndRestore`; `backup_dir` must be readable
    by every worker.

  Example:

  >>> import tfpar
  >>> backup = tfpar.BackupAndRestore("/tmp/backup")
  """

  def _save_model(self):
    if is_chief(self.model):
      super()._save_model()

  def on_train_end(self, logs=None):
    if is_chief(self.model):
      super().on_train_end(logs)
