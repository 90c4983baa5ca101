"""A worker that waits too long in a step for its peers fails, naming them.

Every `fit`, `evaluate` and `predict` step of a multi-worker tfpar strategy
runs under `watching`: a thread of this process (one for all strategies)
notes when the step started, and when it has run for the collective
timeout (`TFPAR_COLLECTIVE_TIMEOUT`, `tfpar.timeouts`), it finds out from
the other workers which of them is not in the step (`tfpar.peer_report`)
and aborts this worker's collectives with that message, through
TensorFlow's `abort_collective_ops` (what TF's own peer health check
uses). Time spent tracing the step does not count.

Errors of a step whose peer died (TensorFlow's heartbeat and connection
errors) are raised again with the worker's name and address.

For a custom training loop, run each step under `watching`:

>>> from tfpar import watchdog
>>> with watchdog.watching(strategy, "my step 3"):  # doctest: +SKIP
...   train_step(next(iterator))
"""

import contextlib
import itertools
import threading
import time

import tensorflow as tf

from tfpar import peer_report
from tfpar._compat import distribute
from tfpar._compat import runtime
from tfpar._compat.keras_modules import tf_trainer
from tfpar.common import strategy_hooks

_installed = []


class _Watch:
  """One armed step."""

  def __init__(self, layout, timeout, what):
    self.layout, self.timeout, self.what = layout, timeout, what
    self.started = time.monotonic()
    self.report = None  # "" while firing, then the message.
    self.fired = threading.Event()


class _Watchdog:
  """The process's watchdog thread and its stack of armed steps."""

  def __init__(self):
    self._changed = threading.Condition()
    self._watches = []
    self._thread = None

  def arm(self, watch):
    with self._changed:
      self._watches.append(watch)
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tfpar-watchdog")
        self._thread.start()
      self._changed.notify()

  def disarm(self, watch):
    with self._changed:
      self._watches.remove(watch)
      self._changed.notify()

  def touch(self):
    """Restarts the clock of the innermost step (it was tracing)."""
    with self._changed:
      if self._watches and self._watches[-1].report is None:
        self._watches[-1].started = time.monotonic()
        self._changed.notify()

  def _run(self):
    while True:
      with self._changed:
        watch = self._watches[-1] if self._watches else None
        if watch is None or watch.report is not None:
          self._changed.wait()
          continue
        left = watch.started + watch.timeout - time.monotonic()
        if left > 0:
          self._changed.wait(left)
          continue
        watch.report = ""  # Fired: the step's own thread reads the report.
      self._fire(watch)

  def _fire(self, watch):
    try:
      report = peer_report.stuck_report(
          watch.layout, watch.what, time.monotonic() - watch.started,
          peer_report.grace_seconds(watch.timeout))
      with self._changed:
        came = watch not in self._watches  # The peers came after all.
        watch.report = None if came else report
      if came:
        peer_report.withdraw(watch.layout)
        return
      runtime.abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, report)
    except Exception as error:  # pylint: disable=broad-except
      # The watchdog must outlive a failed report; it tries again later.
      watch.started, watch.report = time.monotonic(), None
      print(f"tfpar watchdog: could not report a stuck step: {error}",
            flush=True)
    finally:
      watch.fired.set()


_WATCHDOG = _Watchdog()


def touch():
  """Called by the engine when it has traced a step's replica function."""
  _WATCHDOG.touch()


def _layout_and_timeouts(strategy):
  hooks = strategy_hooks.of(strategy)
  timeouts, mesh = hooks.timeouts, hooks.mesh
  if timeouts is None or mesh is None or not mesh.is_multi_worker:
    return None, None
  return mesh.cluster, timeouts


@contextlib.contextmanager
def watching(strategy, what):
  """Runs the body as one step of `strategy` under the watchdog.

  Errors of the body that name a stuck or dead peer are raised again,
  with the same `tf.errors` class, naming the worker. Outside a
  multi-worker tfpar strategy it does nothing.

  Args:
    strategy: the tfpar strategy the step runs under.
    what: how reports name the step, e.g. `"train step 12"`.
  """
  layout, timeouts = _layout_and_timeouts(strategy)
  if layout is None:
    yield
    return
  ordinal = distribute.strategy_ordinal(strategy)
  what = f"{what} of strategy #{ordinal} ({type(strategy).__name__})"
  watch = None
  if timeouts.collective is not None:
    watch = _Watch(layout, timeouts.collective, what)
    _WATCHDOG.arm(watch)
  try:
    yield
  except tf.errors.OpError as error:
    if watch is not None and watch.report == "":  # Asking the peers now.
      watch.fired.wait(timeout=2 * watch.timeout)
    if watch is not None and watch.report:
      raise type(error)(error.node_def, error.op, watch.report) from error
    forwarded = peer_report.forwarded(str(error))
    if forwarded:  # A peer's watchdog aborted a collective we shared.
      raise type(error)(error.node_def, error.op, forwarded) from error
    if "Collective has timed out" in str(error):  # TF's own timeout.
      waited = time.monotonic() - watch.started if watch else 0
      raise type(error)(error.node_def, error.op, peer_report.stuck_report(
          layout, what, waited, peer_report.grace_seconds(
              timeouts.collective or 10))) from error
    clear = peer_report.explain(error, layout, timeouts)
    if clear is None:
      raise
    raise clear from error
  finally:
    if watch is not None:
      _WATCHDOG.disarm(watch)


def _watched(model, kind, function):
  numbers = itertools.count(1)

  def step(*args, **kwargs):
    strategy = model.distribute_strategy
    if _layout_and_timeouts(strategy)[0] is None:
      return function(*args, **kwargs)
    with watching(strategy, f"{kind} step {next(numbers)}"):
      return function(*args, **kwargs)
  step.tfpar_watched = True
  return step


def install():
  """Makes Keras's train, test and predict functions run under `watching`
  (idempotent)."""
  if _installed:
    return
  for kind, attribute in (("train", "train_function"),
                          ("test", "test_function"),
                          ("predict", "predict_function")):
    maker = f"make_{attribute}"
    original = getattr(tf_trainer.TensorFlowTrainer, maker, None)
    if original is None:
      raise RuntimeError(
          f"tfpar's watchdog cannot wrap this Keras's steps: "
          f"TensorFlowTrainer has no {maker}.")
    setattr(tf_trainer.TensorFlowTrainer, maker,
            _watching_maker(original, kind, attribute))
  _installed.append(True)


def _watching_maker(original, kind, attribute):

  def make(self, force=False):
    result = original(self, force=force)
    function = getattr(self, attribute, None)
    if function is not None and not getattr(function, "tfpar_watched", False):
      setattr(self, attribute, _watched(self, kind, function))
      if result is not None:
        result = getattr(self, attribute)
    return result
  make.__wrapped__ = original
  return make
