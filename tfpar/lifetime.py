"""Child processes that never outlive the process that started them.

`tfpar launch` must stop every worker however it ends: its own timeout, a
signal to it (SIGINT, SIGTERM, SIGHUP), a failing worker, or a SIGKILL that
no handler can see. Three mechanisms cover these:

* `spawn` starts each child in its own process group (so that a signal to
  the group reaches the child's own children too) and asks the kernel
  (`prctl(PR_SET_PDEATHSIG, SIGKILL)`) to kill the child when its parent
  dies, which is the only thing that works after a SIGKILL of the parent.
* `StopSignals` turns SIGINT / SIGTERM / SIGHUP into a flag that the
  supervising loop reads, instead of the default (dying at once and leaving
  the children running).
* `stop_all` signals every child's group, waits a grace period, then sends
  SIGKILL to the groups that are left.

No TensorFlow here: the launcher must start fast.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _load_prctl():
  if not sys.platform.startswith("linux"):
    return None
  try:
    return getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
  except OSError:
    return None


# Resolved before any fork: the child only calls it.
_PRCTL = _load_prctl()


def _die_with(parent_pid):
  """A `preexec_fn`: the child gets SIGKILL when `parent_pid` dies."""

  def preexec():
    if _PRCTL is not None:
      _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    # The parent may have died between fork and prctl: then nobody would
    # send the signal, so stop here.
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGKILL)

  return preexec


def spawn(command, env):
  """Starts `command` tied to this process; returns its `subprocess.Popen`.

  The child leads its own process group, has stdin closed and its stdout and
  stderr on one pipe (`process.stdout`), and is killed by the kernel if this
  process dies, even by SIGKILL (Linux).

  Args:
    command: the program and its arguments.
    env: the child's whole environment.

  Returns:
    The `subprocess.Popen` of the child.

  Example:

  >>> process = spawn(["echo", "hi"], dict(os.environ))
  >>> process.stdout.read(), process.wait()
  (b'hi\\n', 0)
  """
  return subprocess.Popen(
      list(command), env=env, stdin=subprocess.DEVNULL,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      start_new_session=True, preexec_fn=_die_with(os.getpid()))


class StopSignals:
  """A context manager that records SIGINT / SIGTERM / SIGHUP.

  Inside it, those signals set `received` (the first signal's number)
  instead of ending the process; the previous handlers come back on exit.
  Off the main thread (where Python cannot install handlers) it does
  nothing and `received` stays None.

  Example:

  >>> with StopSignals() as stop:
  ...   os.kill(os.getpid(), signal.SIGTERM)
  ...   stop.wait(1.0)
  True
  >>> stop.received == signal.SIGTERM
  True
  """

  def __init__(self):
    self.received = None
    self._event = threading.Event()
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.received is None:
      self.received = signum
    self._event.set()

  def wait(self, seconds):
    """Waits up to `seconds` for a signal; returns whether one came."""
    return self._event.wait(seconds)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in STOP_SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous.clear()
    return False


def signal_group(process, sig):
  """Sends `sig` to the process group that `process` leads (see `spawn`)."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(process.pid, sig)


def stop_all(processes, first_signal, grace):
  """Stops every process of `processes` and its group; returns when done.

  Sends `first_signal` to each group, waits up to `grace` seconds for the
  processes to exit, then sends SIGKILL to every group (also the groups of
  processes that did exit, for children they left behind).

  Args:
    processes: `subprocess.Popen` objects started by `spawn`.
    first_signal: the polite signal, e.g. `signal.SIGTERM`.
    grace: seconds to wait before SIGKILL.

  Example:

  >>> sleeper = spawn(["sleep", "60"], dict(os.environ))
  >>> stop_all([sleeper], signal.SIGTERM, grace=5.0)
  >>> sleeper.returncode
  -15
  """
  for process in processes:
    if process.poll() is None:
      signal_group(process, first_signal)
  deadline = time.monotonic() + grace
  for process in processes:
    with contextlib.suppress(subprocess.TimeoutExpired):
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
  for process in processes:
    signal_group(process, signal.SIGKILL)
    process.wait()
