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

import contextlib
import dataclasses
import json

import tensorflow as tf

from tfpar import accumulation_change
from tfpar import keras_hooks
from tfpar import preemption
from tfpar import resume_position
from tfpar._compat import keras_callbacks
from tfpar._compat import keras_optimizers
from tfpar.expert_parallel import whole_experts
from tfpar.zero import checkpoint as zero_checkpoint


def is_chief(model):
  """Whether this process should write checkpoints for `model`."""
  strategy = model.distribute_strategy
  return strategy.extended.should_checkpoint


class ModelCheckpoint(keras_callbacks.ModelCheckpointBase):
  """`keras.callbacks.ModelCheckpoint` that only the chief writes.

  Args: as `keras.callbacks.ModelCheckpoint`.

  Example:

  >>> import tfpar
  >>> checkpoint = tfpar.ModelCheckpoint("/tmp/ckpt/{epoch}.weights.h5",
  ...                                    save_weights_only=True)
  """

  def around_save(self, save):
    with zero_checkpoint.whole_values(self.model):
      if is_chief(self.model):
        save()


class BackupAndRestore(keras_callbacks.BackupAndRestoreBase):
  """`keras.callbacks.BackupAndRestore` for multi-worker jobs, resuming at
  the exact step.

  The chief writes the backup; every worker restores from it, so all
  workers resume with the same weights and optimizer state after a worker
  was killed and the job restarted. With `save_freq=N` (a backup every N
  batches) a restart resumes at the batch after the backup, not at the
  start of its epoch: the batches of that epoch already trained are read
  from the data and skipped, so the model is updated exactly as without
  the interruption (when the data comes in the same order: `shuffle=False`
  or a seeded dataset). The resumed epoch's logged metrics cover only the
  batches trained after the restart.

  With `save_before_preemption` (as in Keras 2), SIGTERM to any worker
  during training (what preemptible machines and schedulers send) makes
  every worker back up the same step, and exit with code 143
  (`tfpar.preemption.PREEMPTED_EXIT_CODE`, TensorFlow's); the relaunched
  job resumes at the next batch.

  A backup resumes on any number of workers and replicas when the global
  batch is kept (`tfpar.keep_global_batch`), also with another
  `gradient_accumulation_steps` when it was made at the end of an
  accumulation (its optimizer state is converted:
  `tfpar.accumulation_change`); a resume that cannot keep it is a
  `ValueError` before anything loads.

  Args:
    backup_dir: as `keras.callbacks.BackupAndRestore`; it must be readable
      by every worker.
    save_freq: "epoch", or a backup every `save_freq` batches.
    double_checkpoint: as `keras.callbacks.BackupAndRestore`.
    delete_checkpoint: as `keras.callbacks.BackupAndRestore`.
    save_before_preemption: whether SIGTERM saves and exits (see above).

  Example:

  >>> import tfpar
  >>> backup = tfpar.BackupAndRestore("/tmp/backup", save_freq=100)
  """

  _BATCHES_DONE = "tfpar_batches_done"  # Of the epoch in the metadata.

  def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
               delete_checkpoint=True, save_before_preemption=True):
    super().__init__(backup_dir, save_freq=save_freq,
                     double_checkpoint=double_checkpoint,
                     delete_checkpoint=delete_checkpoint)
    self.save_before_preemption = save_before_preemption
    self._batches_done = self._to_skip = self._steps_run = 0
    self._preemption = None
    keras_hooks.install_fit_preparation()  # For `finish_fit`.
    # A resume after an interrupted fit first collects its input iterators
    # (tfpar's strategies install these hooks; stock ones do not).
    keras_hooks.install_run_hooks()

  def on_train_begin(self, logs=None):
    # Checked before the backup loads: a resume that cannot keep the global
    # batch is refused before any work.
    to_skip, saved_accumulation = self._resume_position()
    with self._loading_state_of(saved_accumulation):
      super().on_train_begin(logs)
    self._batches_done = self._steps_run = 0
    self._to_skip = to_skip
    if self.save_before_preemption:
      self._preemption = preemption.PreemptionWatch(
          self.model.distribute_strategy)
      self._preemption.install()
    if self._to_skip:
      self._skip_trained_batches()

  def _resume_position(self):
    """The batches of the epoch the backup holds (0: no backup), checked
    against this run's replicas, steps and accumulation, and the
    backup's gradient accumulation (None: unknown)."""
    if not tf.io.gfile.exists(self.metadata_path()):
      return 0, None
    with tf.io.gfile.GFile(self.metadata_path()) as metadata:
      written = json.load(metadata)
    if resume_position.KEY not in written:  # An older backup.
      return written.get(self._BATCHES_DONE, 0), None
    saved = resume_position.Position(**written[resume_position.KEY])
    now = resume_position.of_model(self.model, 0, self.params.get("steps"))
    return resume_position.batches_to_skip(
        saved, now, log=print if is_chief(self.model) else None
    ), saved.accumulation

  def _loading_state_of(self, saved_accumulation):
    """A context in which the backup's optimizer state loads into this
    run's optimizer, whose gradient accumulation may differ."""
    optimizer = getattr(self.model, "optimizer", None)
    if (saved_accumulation is None or optimizer is None or
        saved_accumulation == accumulation_change.accumulation_of(
            optimizer)):
      return contextlib.nullcontext()
    if not optimizer.built:  # As Keras does before loading a backup; the
      # saving of split states is set up when the optimizer is built.
      optimizer.build(self.model.trainable_variables)
    current = {}  # The whole entries it loads, in order: every worker
    # takes part in gathering split ones, as for a save.
    with zero_checkpoint.whole_values(self.model), whole_experts.prefetched(
        self.model):
      optimizer.save_own_variables(current)
    return accumulation_change.loading_across(optimizer, saved_accumulation,
                                              current)

  def _skip_trained_batches(self):
    """Makes the next train-function calls read, and not train on, the
    batches the backup has trained on already."""
    model = self.model
    trained = model.train_function
    left = [self._to_skip]

    def train_function(iterator):
      if not left[0]:
        model.train_function = trained
        return trained(iterator)
      for _ in range(min(model.steps_per_execution, left[0])):
        next(iterator)
      left[0] -= min(model.steps_per_execution, left[0])
      return {}
    model.train_function = train_function

  def on_epoch_begin(self, epoch, logs=None):
    # Keras sets the epoch it records only at epoch ends, so the backups of
    # a resumed run taken before its first epoch end would name epoch 0.
    self._current_epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    if batch < self._to_skip:  # A skipped batch: the backup holds it.
      return
    self._batches_done = batch + 1
    super().on_train_batch_end(batch, logs)
    self._steps_run += 1
    if self._preemption and self._preemption.save_now(
        self._steps_run, self._steps_to_accumulation_boundary):
      self.save_backup()
      self._preemption.exit_after_save(is_chief(self.model))

  def _steps_to_accumulation_boundary(self):
    """Steps after the next one until the optimizer next updates (a backup
    in the middle of an accumulation cannot resume on another one)."""
    optimizer = self.model.optimizer
    steps = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    micro_steps = int(keras_optimizers.iterations_variable(optimizer).numpy())
    return (-(micro_steps + 1)) % steps

  def on_epoch_end(self, epoch, logs=None):
    self._batches_done = self._to_skip = 0
    super().on_epoch_end(epoch, logs)

  def around_save(self, save):
    with zero_checkpoint.whole_values(self.model):
      if is_chief(self.model):
        save()
        with tf.io.gfile.GFile(self.metadata_path()) as metadata:
          written = json.load(metadata)
        written[self._BATCHES_DONE] = self._batches_done
        written[resume_position.KEY] = dataclasses.asdict(
            resume_position.of_model(self.model, self._batches_done,
                                     self.params.get("steps")))
        with tf.io.gfile.GFile(self.metadata_path(), "w") as metadata:
          json.dump(written, metadata)

  def finish_fit(self, model):
    """Gives SIGTERM back however `fit` ended (called by tfpar's `fit`
    hook: Keras skips `on_train_end` when `fit` raises)."""
    del model
    if self._preemption:
      self._preemption.uninstall()
      self._preemption = None

  def on_train_end(self, logs=None):
    self.finish_fit(self.model)
    if is_chief(self.model):
      super().on_train_end(logs)


def save_weights(model, filepath, **kwargs):
  """`model.save_weights(filepath)` for a job of one or several workers.

  Every worker calls it, at the same point of the program: under
  `tfpar.ZeRO`, and under `tfpar.ExpertParallelStrategy` with expert groups
  that span workers, the workers gather the whole tensors together, then
  the chief writes them. On one process it is `model.save_weights`.

  Args:
    model: a Keras model.
    filepath: a `.weights.h5` path, on storage the chief can write.
    **kwargs: passed on to `model.save_weights`.

  Example:

  >>> import keras, tfpar
  >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  >>> tfpar.save_weights(model, "/tmp/tfpar_doc.weights.h5")
  """
  with zero_checkpoint.whole_values(model), whole_experts.prefetched(model):
    if is_chief(model):
      model.save_weights(filepath, **kwargs)
