"""Saving before a preemption: SIGTERM to any worker makes every worker save
the same step, then exit with `PREEMPTED_EXIT_CODE`.

Spot and preemptible machines, and schedulers, announce the end of a
process with SIGTERM. Synchronous training needs every worker to save the
same step, so the worker that got the signal announces, through the
cluster's coordination service (TensorFlow's key-value store, which its own
`PreemptionCheckpointHandler` uses), the step after the one it has just
finished, as TensorFlow's handler does:

* every worker watches the announcement key from a thread (the store has no
  read that tells a missing key from a slow reply, so a step cannot poll
  it), takes the step and acknowledges it;
* the announcing worker starts the announced step only once every worker
  has acknowledged, so no worker can finish that step without knowing it
  (the step's all-reduce waits for every worker).

After the save the workers wait for the chief's write, and the chief for
every worker's reading of it before it exits: it runs the coordination
service, so no worker exits 143 before the checkpoint is written, and none
loses the store while it still needs it.

TensorFlow's key-value store is reached through `tfpar._compat.runtime`
(TensorFlow's eager context), checked at import, so an upgrade that moves
it fails loudly.
"""

import os
import signal
import sys
import threading
import time

import tensorflow as tf

from tfpar._compat import runtime
from tfpar.environment import ELASTIC_STATE_DIR_ENV

PREEMPTED_EXIT_CODE = 143  # As TensorFlow's PreemptionCheckpointHandler.
_TIMEOUT_SECONDS = 120.0  # How long a worker waits for the other workers.
_STOP_WATCHING = "stop"  # Written over an unannounced key after training.
_generations = [0]  # Watches made in this process: the same on every worker.


def _key_value_store():
  # runtime checks at import that the context has the key-value methods.
  return runtime.context()


def _tasks(strategy):
  """`(this task, every task)` of `strategy`'s cluster, as `job:index`
  names (`(None, [])` without a cluster)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
  tasks = [f"{job}:{index}" for job in ("chief", "worker")
           for index in range(len(spec.get(job, ())))]
  if not tasks:
    return None, []
  return f"{resolver.task_type}:{resolver.task_id}", tasks


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
    self._task, self._tasks = _tasks(strategy)
    _generations[0] += 1
    self._key = f"tfpar/preemption/{_generations[0]}"
    self._signalled = threading.Event()
    self._announced = False
    self._save_at = None
    self._previous = None
    self._watcher = None

  @property
  def _multi_worker(self):
    return len(self._tasks) > 1

  def install(self):
    """Catches SIGTERM from now on (only the main thread can) and, with
    several workers, starts watching for an announced step."""
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM,
                                     lambda *_: self._signalled.set())
    if self._multi_worker:
      self._watcher = threading.Thread(target=self._watch, daemon=True,
                                       name="tfpar-preemption-watch")
      self._watcher.start()

  def uninstall(self):
    """Gives SIGTERM back and stops watching."""
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
    if self._watcher is not None and self._watcher.is_alive():
      try:
        _key_value_store().set_config_key_value(self._key, _STOP_WATCHING)
      except tf.errors.OpError:  # Announced meanwhile, or the store is gone.
        pass
      self._watcher.join(timeout=_TIMEOUT_SECONDS)
    self._watcher = None

  def save_now(self, steps_run, steps_to_boundary=lambda: 0):
    """Whether every worker saves now; called on every worker after each
    step, with the number of steps run so far (the same on every worker).

    `steps_to_boundary()` (asked once, after a SIGTERM) is how many steps
    after the next one end a unit the save must not cut (an accumulation
    of gradients); the save waits for them."""
    if not self._multi_worker:
      if self._signalled.is_set() and self._save_at is None:
        self._save_at = steps_run + steps_to_boundary()
      return self._save_at == steps_run
    if self._signalled.is_set() and not self._announced:
      self._announced = True
      try:
        _key_value_store().set_config_key_value(
            self._key, str(steps_run + 1 + steps_to_boundary()))
      except tf.errors.AlreadyExistsError:  # Another worker was first.
        pass
      else:
        self._wait_for_every_task("received", self._tasks)
    return self._save_at == steps_run

  def _watch(self):
    store = _key_value_store()
    try:
      value = store.get_config_key_value(self._key)
      if value != _STOP_WATCHING:
        self._save_at = int(value)
        store.set_config_key_value(f"{self._key}/received/{self._task}", "1")
    except tf.errors.OpError:  # The store is gone: the job is ending.
      pass

  def _wait_for_every_task(self, what, tasks):
    """Waits until each of `tasks` has set `<key>/<what>/<task>`."""
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    for task in tasks:
      left_ms = max(1, int(1000 * (deadline - time.monotonic())))
      try:
        _key_value_store().get_config_key_value(f"{self._key}/{what}/{task}",
                                                timeout_in_ms=left_ms)
      except tf.errors.DeadlineExceededError:
        raise RuntimeError(
            f"tfpar preemption: task {task} did not report '{what}' within "
            f"{_TIMEOUT_SECONDS:.0f} s of the others") from None

  def _mark_preempted(self):
    """Under `tfpar launch --elastic`, tells the launcher that this worker
    got the SIGTERM, so that the restart leaves its machine out."""
    folder = os.environ.get(ELASTIC_STATE_DIR_ENV)
    if folder and self._signalled.is_set() and os.path.isdir(folder):
      index = (self._task or "worker:0").rpartition(":")[2]
      with open(os.path.join(folder, f"preempted.{index}"), "w"):
        pass

  def exit_after_save(self, is_chief):
    """Waits until the chief has written the checkpoint (the chief: until
    every worker knows it), then exits with `PREEMPTED_EXIT_CODE`."""
    if self._multi_worker:
      if is_chief:
        _key_value_store().set_config_key_value(
            f"{self._key}/saved/{self._task}", "1")
        self._wait_for_every_task(
            "read", [task for task in self._tasks if task != self._task])
      else:
        self._wait_for_every_task("saved", self._tasks[:1])  # The chief.
        _key_value_store().set_config_key_value(
            f"{self._key}/read/{self._task}", "1")
    self._mark_preempted()
    print(f"tfpar: preempted (SIGTERM); saved, exiting with "
          f"{PREEMPTED_EXIT_CODE}. Relaunch to resume.", flush=True)
    self.uninstall()
    sys.exit(PREEMPTED_EXIT_CODE)
