"""The save step of Keras's checkpoint callbacks.

`keras.callbacks.ModelCheckpoint` and `BackupAndRestore` write through a
private `_save_model`; tfpar's versions must wrap every write (gather
ZeRO's slices into whole values, write on the chief only). These bases
route each write through `around_save(save)`, and check at import that
Keras still saves through `_save_model` (`Incompatible` otherwise: a
silently skipped wrapper would write one replica's slices).
"""

import keras

from tfpar._compat.checks import require

require(keras.callbacks.ModelCheckpoint, "_save_model", "checkpoint writes")
require(keras.callbacks.BackupAndRestore, "_save_model", "backup writes")


class ModelCheckpointBase(keras.callbacks.ModelCheckpoint):
  """`keras.callbacks.ModelCheckpoint` whose writes run inside
  `self.around_save(save)` (default: just `save()`)."""

  def around_save(self, save):
    save()

  def _save_model(self, epoch, batch, logs):
    self.around_save(lambda: super(ModelCheckpointBase, self)._save_model(
        epoch, batch, logs))


class BackupAndRestoreBase(keras.callbacks.BackupAndRestore):
  """`keras.callbacks.BackupAndRestore` whose writes run inside
  `self.around_save(save)`; `save_backup()` writes one now."""

  def around_save(self, save):
    save()

  def save_backup(self):
    """Writes a backup now (as Keras does at its save frequency)."""
    self._save_model()

  def _save_model(self):
    self.around_save(super()._save_model)

  def metadata_path(self):
    """The JSON file Keras keeps the backup's epoch and batch in."""
    return require(self, "_training_metadata_path", "backup metadata")
