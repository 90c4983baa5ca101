"""Bounded waits of a multi-worker job: connecting, collectives, heartbeats.

Three limits, in seconds, each set by an environment variable (read when
a strategy is created, on every worker):

* `TFPAR_CONNECT_TIMEOUT` (default 300): how long the first strategy waits
  for every worker to join the cluster. TensorFlow's coordination service
  enforces it (`cluster_register_timeout_in_ms` with a registration
  barrier); the error names the tasks that did not connect.
* `TFPAR_COLLECTIVE_TIMEOUT` (default 600): how long a worker waits inside
  one `fit`/`evaluate`/`predict` step for its peers (`tfpar.watchdog`).
  TensorFlow's own `CommunicationOptions(timeout_seconds=...)` is not used
  as the default: it starts one thread per collective that sleeps for the
  whole timeout (measured: 766 threads after 160 steps with 60 s).
* `TFPAR_HEARTBEAT_TIMEOUT` (default: TensorFlow's, 10 s): after how long
  without heartbeats the coordination service declares a worker dead (a
  killed, stopped or unreachable process); every worker's collectives then
  fail, naming it.

`0`, `none` or `inf` removes a limit.
"""

import dataclasses
import math
import os
import re

import tensorflow as tf

from tfpar._compat import runtime

CONNECT_ENV = "TFPAR_CONNECT_TIMEOUT"
COLLECTIVE_ENV = "TFPAR_COLLECTIVE_TIMEOUT"
HEARTBEAT_ENV = "TFPAR_HEARTBEAT_TIMEOUT"
DEFAULT_CONNECT = 300.0
DEFAULT_COLLECTIVE = 600.0
_TASK = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")


@dataclasses.dataclass(frozen=True)
class Timeouts:
  """The limits of one process, in seconds (None: no limit).

  Attributes:
    connect: for every worker to join the cluster.
    collective: for the peers inside one step.
    heartbeat: before a silent worker is declared dead (None: TF's 10 s).

  Example:

  >>> Timeouts.from_environment({"TFPAR_COLLECTIVE_TIMEOUT": "30"}).collective
  30.0
  """

  connect: float = DEFAULT_CONNECT
  collective: float = DEFAULT_COLLECTIVE
  heartbeat: float = None

  @classmethod
  def from_environment(cls, environ=None):
    """Reads the three variables (see the module docstring).

    Raises:
      ValueError: a value that is not a number of seconds.
    """
    environ = os.environ if environ is None else environ
    return cls(_seconds(environ, CONNECT_ENV, DEFAULT_CONNECT),
               _seconds(environ, COLLECTIVE_ENV, DEFAULT_COLLECTIVE),
               _seconds(environ, HEARTBEAT_ENV, None))


def _seconds(environ, name, default):
  text = environ.get(name, "").strip()
  if not text:
    return default
  if text.lower() in ("0", "none", "inf"):
    return None
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value < math.inf:
    raise ValueError(
        f"{name} must be a positive number of seconds (or 0, none, inf for "
        f"no limit). Received: {name}={text!r}")
  return value


def configure_coordination(layout, timeouts):
  """Sets the connect and heartbeat limits of TF's coordination service.

  Must run before the process's first multi-worker strategy starts its
  server; TF's `CollectiveAllReduceExtended` then keeps this configuration
  (it configures the service only when nothing has). A configuration made
  earlier (by the user or a first strategy) is left alone.

  Args:
    layout: this process's `tfpar.cluster.ClusterLayout`.
    timeouts: a `Timeouts`.
  """
  # Without the registration barrier, the first task waits for the others
  # in `WaitForAllTasks`, which ignores the register timeout (a peer that
  # never starts: "Waiting for 1/2 tasks to connect." for ever).
  runtime.configure_coordination_service(
      layout.cluster_spec, _milliseconds(timeouts.connect),
      _milliseconds(timeouts.heartbeat),
      use_barrier=timeouts.connect is not None)


def _milliseconds(seconds):
  return 0 if seconds is None else max(1, int(seconds * 1000))


def task_name(layout, job, index):
  """How errors name a task: `'worker 1 (127.0.0.1:2223)'`.

  Example:

  >>> task_name(None, "worker", 1)
  'worker 1'
  """
  name = "chief" if job == "chief" else f"{job} {index}"
  if layout is not None and job in layout.cluster_spec:
    name += f" ({layout.cluster_spec[job][int(index)]})"
  return name


def tasks_named_in(text):
  """The `(job, index)` pairs a TensorFlow message names, in order.

  Example:

  >>> tasks_named_in("timed out: /job:worker/replica:0/task:1 and task:1")
  [('worker', 1)]
  """
  found = []
  for job, index in _TASK.findall(text):
    if (job, int(index)) not in found:
      found.append((job, int(index)))
  return found


def connect_error(error, layout, timeouts):
  """A clear error for a cluster that did not form in time, or None.

  Args:
    error: what TF raised while the first strategy started its server.
    layout: this process's `ClusterLayout`.
    timeouts: the `Timeouts` in force.
  """
  if not isinstance(error, tf.errors.DeadlineExceededError):
    return None
  message = str(error)
  wait = f"{timeouts.connect:g} s ({CONNECT_ENV})"
  me = task_name(layout, layout.task_type, layout.task_id)
  if "Wait_for_all_tasks_to_register" in message:
    _, _, stragglers = message.partition("timed out task names:")
    missing = [task_name(layout, job, index)
               for job, index in tasks_named_in(stragglers.split("\n\n")[0])]
    text = (f"{', '.join(missing) or 'Some tasks'} did not connect to the "
            f"cluster within {wait}: not started, crashed while starting, or "
            f"unable to reach the chief. Seen from {me}.")
  elif "RegisterTask" in message:
    leader = _leader(layout)
    text = (f"{task_name(layout, *leader)}, which runs the cluster's "
            f"coordination service, did not answer {me} within {wait}: it "
            f"has not started, or cannot be reached at that address.")
  else:
    return None
  return tf.errors.DeadlineExceededError(None, None, text)


def _leader(layout):
  if "chief" in layout.cluster_spec:
    return "chief", 0
  return "worker", 0
