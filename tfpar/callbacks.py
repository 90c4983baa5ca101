"""Keras checkpoint callbacks that are safe with several workers.

Stock Keras 3 callbacks make every worker write the same files at the same
moment. These subclasses let the chief alone write, while every worker reads
the chief's files, which is TF's multi-worker convention (the checkpoint
directory is on storage all workers can read). On one process they behave
exactly like the Keras callbacks.

Under `tfpar.ZeRO` in a multi-worker job, each worker holds only its slices
of the optimizer state (and at stage 3 of the weights): every worker then
takes part in gathering the whole tensors, and the chief writes them.
"""

import keras
import tensorflow as tf

from tfpar.zero import checkpoint as zero_checkpoint


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
    with zero_checkpoint.whole_values(self.model):
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
    with zero_checkpoint.whole_values(self.model):
      if is_chief(self.model):
        super()._save_model()

  def on_train_end(self, logs=None):
    if is_chief(self.model):
      super().on_train_end(logs)


def save_weights(model, filepath, **kwargs):
  """`model.save_weights(filepath)` for a job of one or several workers.

  Every worker calls it, at the same point of the program: under
  `tfpar.ZeRO` the workers gather the whole tensors together, then the chief
  writes them. On one process it is `model.save_weights`.

  Args:
    model: a Keras model.
    filepath: a `.weights.h5` path, on storage the chief can write.
    **kwargs: passed on to `model.save_weights`.

  Example:

  >>> import keras, tfpar
  >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  >>> tfpar.save_weights(model, "/tmp/tfpar_doc.weights.h5")
  """
  with zero_checkpoint.whole_values(model):
    if is_chief(model):
      model.save_weights(filepath, **kwargs)
