"""Saving before a preemption: SIGTERM to any worker makes every worker save
the same step, then exit with `PREEMPTED_EXIT_CODE`.

Spot and preemptible machines, and schedulers, announce the end of a
process with SIGTERM. Synchronous training needs every worker to save the
same step, so the worker that got the signal announces, through the
cluster's coordination service (TensorFlow's key-value store, which its own
`PreemptionCheckpointHandler` uses), the step after the one it has just
finished; every worker reads the store after each step. This is exact
without any acknowledgement: no worker can finish the announced step before
the announcing worker has started it (the step's all-reduce waits for every
worker), and it announces before starting it.

TensorFlow's key-value store is reached through `tfpar._compat.runtime`
(TensorFlow's eager context), checked at import, so an upgrade that moves
it fails loudly.
"""

import signal
import sys
import threading

import tensorflow as tf

from tfpar._compat import runtime

PREEMPTED_EXIT_CODE = 143  # As TensorFlow's PreemptionCheckpointHandler.
_SAVED_TIMEOUT_MS = 120_000  # How long workers wait for the chief's write.
_generations = [0]  # Watches made in this process: the same on every worker.


def _key_value_store():
  # runtime checks at import that the context has the key-value methods.
  return runtime.context()


def worker_count(strategy):
  """The number of worker processes of `strategy`'s cluster (1 when it has
  none)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
  return sum(len(spec.get(job, ())) for job in ("chief", "worker")) or 1


class PreemptionWatch:
  """Turns SIGTERM into a step at which every worker saves.

  Args:
    strategy: the strategy the model trains under.

  Example:

  >>> import os, signal, tensorflow as tf
  >>> watch = PreemptionWatch(tf.distribute.get_strategy())
  >>> watch.install()
  >>> watch.save_now(steps_run=1)
  False
  >>> os.kill(os.getpid(), signal.SIGTERM)
  >>> watch.save_now(steps_run=2)
  True
  >>> watch.uninstall()
  """

  def __init__(self, strategy):
    self._workers = worker_count(strategy)
    _generations[0] += 1
    self._key = f"tfpar/preemption/{_generations[0]}"
    self._signalled = threading.Event()
    self._announced = False
    self._save_at = None
    self._previous = None

  def install(self):
    """Catches SIGTERM from now on (only the main thread can)."""
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM,
                                     lambda *_: self._signalled.set())

  def uninstall(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def save_now(self, steps_run):
    """Whether every worker saves now; called on every worker after each
    step, with the number of steps run so far (the same on every worker)."""
    if self._workers == 1:
      return self._signalled.is_set()
    if self._save_at is None:
      if self._signalled.is_set() and not self._announced:
        self._announced = True
        try:
          _key_value_store().set_config_key_value(self._key,
                                                  str(steps_run + 1))
        except tf.errors.AlreadyExistsError:  # Another worker was first.
          pass
      self._save_at = self._announced_step()
    return self._save_at == steps_run

  def _announced_step(self):
    try:
      return int(_key_value_store().get_config_key_value(
          self._key, timeout_in_ms=1))
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError,
            tf.errors.UnavailableError):
      return None

  def exit_after_save(self, is_chief):
    """Waits until the chief has written the checkpoint, then exits."""
    if self._workers > 1:
      store = _key_value_store()
      if is_chief:
        store.set_config_key_value(f"{self._key}/saved", "1")
      else:
        store.get_config_key_value(f"{self._key}/saved",
                                   timeout_in_ms=_SAVED_TIMEOUT_MS)
    print(f"tfpar: preempted (SIGTERM); saved, exiting with "
          f"{PREEMPTED_EXIT_CODE}. Relaunch to resume.", flush=True)
    self.uninstall()
    sys.exit(PREEMPTED_EXIT_CODE)
