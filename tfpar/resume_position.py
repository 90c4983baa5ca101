"""Where a backup stands in training, and where a resume on another number
of replicas or workers starts.

`tfpar.BackupAndRestore` records, with each backup, the batches of the
epoch it holds, the steps per epoch, the gradient accumulation, and the
replicas and workers it ran on. A resume compares them with its own run:
the weights and optimizer state load whole on any number of replicas (the
backup holds whole tensors, resharded as they load), and the input
position is kept when every optimizer update still averages the same
examples, i.e. the run makes as many updates per epoch. A resume that
changes that (the global batch) is a `ValueError` naming the numbers,
raised before the backup is loaded. The gradient accumulation may change
(`tfpar.accumulation_change` converts the optimizer state) when each
epoch holds whole accumulations and the backup was made at the end of
one; the resume then skips as many updates' batches.
"""

import dataclasses

KEY = "tfpar_resume"  # Of the backup's metadata.


@dataclasses.dataclass(frozen=True)
class Position:
  """A run's position and shape, as recorded with a backup.

  Attributes:
    batches_done: batches of the current epoch the backup holds.
    steps_per_epoch: `fit`'s steps per epoch (None: unknown).
    accumulation: the optimizer's gradient accumulation steps (1: none).
    replicas: data replicas (`num_replicas_in_sync`).
    workers: worker processes.
  """

  batches_done: int
  steps_per_epoch: int
  accumulation: int
  replicas: int
  workers: int

  def describe(self):
    accumulation = (f", gradient_accumulation_steps {self.accumulation}"
                    if self.accumulation > 1 else "")
    return (f"{self.replicas} replicas on {self.workers} worker(s), "
            f"{self.steps_per_epoch} steps per epoch{accumulation}")


def of_model(model, batches_done, steps_per_epoch):
  """The `Position` of `model`'s run after `batches_done` batches.

  Example:

  >>> import keras
  >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  >>> model.compile(optimizer="sgd", loss="mse")
  >>> of_model(model, 3, 8)
  Position(batches_done=3, steps_per_epoch=8, accumulation=1, replicas=1, workers=1)
  """
  strategy = model.distribute_strategy
  mesh = getattr(strategy, "mesh", None)
  optimizer = getattr(model, "optimizer", None)
  return Position(
      batches_done=batches_done, steps_per_epoch=steps_per_epoch,
      accumulation=getattr(optimizer, "gradient_accumulation_steps",
                           None) or 1,
      replicas=strategy.num_replicas_in_sync,
      workers=mesh.num_workers if mesh is not None else 1)


def batches_to_skip(saved, now, log=print):
  """How many batches of the resumed epoch the resume skips.

  Args:
    saved: the `Position` recorded with the backup.
    now: the resuming run's `Position` (its `batches_done` unused).
    log: called with the line that states the resume (None: silent).

  Raises:
    ValueError: when the resume cannot keep the global batch or the input
      position, naming the numbers.

  Example:

  >>> saved = Position(4, 8, 1, replicas=6, workers=3)
  >>> batches_to_skip(saved, Position(0, 8, 1, replicas=4, workers=2))
  tfpar: resuming at batch 4 of the epoch, on 4 replicas on 2 worker(s), 8 steps per epoch, from a backup made on 6 replicas on 3 worker(s), 8 steps per epoch: the same 8 optimizer updates per epoch (the global batch kept)
  4
  """
  if saved.steps_per_epoch is None or now.steps_per_epoch is None:
    if (saved.replicas, saved.accumulation) != (now.replicas,
                                                now.accumulation):
      raise ValueError(
          f"Cannot resume a backup made on {saved.describe()} on "
          f"{now.describe()}: with a dataset of unknown length, tfpar "
          f"cannot check that the global batch is kept. Pass fit "
          f"steps_per_epoch.")
    return saved.batches_done
  if saved.accumulation != now.accumulation:
    _check_accumulation_change(saved, now)
  updates_saved = saved.steps_per_epoch / saved.accumulation
  updates_now = now.steps_per_epoch / now.accumulation
  if updates_saved != updates_now:
    raise ValueError(
        f"Cannot resume a backup made on {saved.describe()} "
        f"({updates_saved:g} optimizer updates per epoch) on "
        f"{now.describe()} ({updates_now:g} updates per epoch): the global "
        f"batch changed, so the resumed run would not train as the "
        f"interrupted one. Pass fit the same global batch_size on every "
        f"number of replicas (tfpar.keep_global_batch computes the "
        f"per-replica batch).")
  to_skip = saved.batches_done
  if saved.accumulation != now.accumulation:  # The same updates, in
    # another number of batches.
    to_skip = saved.batches_done // saved.accumulation * now.accumulation
  if log is not None:
    log(f"tfpar: resuming at batch {to_skip} of the epoch, on "
        f"{now.describe()}, from a backup made on {saved.describe()}: the "
        f"same {updates_now:g} optimizer updates per epoch (the global "
        f"batch kept)")
  return to_skip


def _check_accumulation_change(saved, now):
  """Raises a ValueError unless a resume may change the gradient
  accumulation: whole accumulations in each epoch, the backup at the end
  of one."""
  for position in (saved, now):
    if position.steps_per_epoch % position.accumulation:
      raise ValueError(
          f"Cannot resume a backup made on {saved.describe()} on "
          f"{now.describe()}: {position.steps_per_epoch} steps per epoch "
          f"are not a whole number of accumulations of "
          f"{position.accumulation} steps, so an update would span two "
          f"epochs. Keep gradient_accumulation_steps={saved.accumulation} "
          f"or pick a batch whose steps per epoch divide evenly.")
  if saved.batches_done % saved.accumulation:
    raise ValueError(
        f"Cannot resume a backup made on {saved.describe()} after "
        f"{saved.batches_done} batches of the epoch, in the middle of an "
        f"accumulation of {saved.accumulation}, with "
        f"gradient_accumulation_steps {now.accumulation}. Keep "
        f"gradient_accumulation_steps={saved.accumulation}.")
