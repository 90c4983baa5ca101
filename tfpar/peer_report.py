"""Which worker a stuck or failed step waited for, in words.

Two sources:

* When a worker has waited too long in a step (`tfpar.watchdog`), it posts
  what it waits in to the cluster's coordination service (TensorFlow's
  key-value store, which also runs `PreemptionCheckpointHandler`) and reads
  the other workers' posts for a short grace period. A worker that posted
  nothing is not in the step (alive, since its heartbeats arrive, but busy
  or stuck elsewhere); one that waits in another step or strategy shows a
  mismatch (e.g. the chief created one strategy more than the others).
* When TensorFlow aborts the collectives because a peer died or stopped
  sending heartbeats, its message names tasks in TF's syntax, or only the
  coordination service's heartbeat RPC when the chief is gone; `explain`
  turns it into the worker's name and address.

TensorFlow's key-value store is reached through `tfpar._compat.runtime`
(TensorFlow's eager context, as in `tfpar.preemption`).
"""

import json
import re
import threading
import time

import tensorflow as tf

from tfpar import timeouts as timeouts_lib
from tfpar._compat import runtime

_PREFIX = "tfpar/waiting"
_LINGER_SECONDS = 3.0  # The chief keeps its store up for the others' reads.
_FORWARDED = re.compile(
    r"aborted by: (?:Collective ops is aborted by: )*"
    r"((?:chief|\w+ \d+)(?: \([^)]*\))? waited \d+ s \(" +
    timeouts_lib.COLLECTIVE_ENV + r"\)[^\n]*)")


def grace_seconds(collective_timeout):
  """How long a stuck worker waits for the others' posts.

  Example:

  >>> grace_seconds(600), grace_seconds(10)
  (30.0, 2.5)
  """
  return min(max(collective_timeout / 4, 2.0), 30.0)


def _store():
  return runtime.context()


def _key(task, suffix=""):
  return f"{_PREFIX}/{task[0]}:{task[1]}{suffix}"


def exchange(layout, what, grace):
  """Posts `what` this worker waits in; returns `{task: what or None}` for
  the other tasks, None for those that posted nothing within `grace` s."""
  store = _store()
  me = (layout.task_type, layout.task_id)
  try:
    store.set_config_key_value(_key(me), json.dumps({"what": what}))
  except tf.errors.AlreadyExistsError:
    pass
  deadline = time.monotonic() + grace
  seen = {}
  for task in layout.tasks:
    if task == me:
      continue
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      seen[task] = json.loads(store.get_config_key_value(
          _key(task), timeout_in_ms=left_ms))["what"]
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError,
            tf.errors.UnavailableError):
      seen[task] = None
  try:
    store.set_config_key_value(_key(me, "/read"), "1")
  except tf.errors.AlreadyExistsError:
    pass
  if layout.is_chief:  # Its process hosts the store: let the others read.
    for task in [t for t, w in seen.items() if w is not None]:
      try:
        store.get_config_key_value(_key(task, "/read"),
                                   timeout_in_ms=int(_LINGER_SECONDS * 1000))
      except tf.errors.OpError:
        break
  return seen


def withdraw(layout):
  """Deletes this worker's posts (its step ended after all)."""
  me = (layout.task_type, layout.task_id)
  for key in (_key(me), _key(me, "/read")):
    try:
      _store().delete_config_key_value(key)
    except tf.errors.OpError:
      pass


def stuck_report(layout, what, waited, grace):
  """The message of a worker that waited `waited` s in `what`.

  The exchange runs in a thread of its own: a frozen chief would block the
  store's calls for ever.
  """
  result = {}
  thread = threading.Thread(
      target=lambda: result.update(seen=exchange(layout, what, grace)),
      daemon=True)
  thread.start()
  thread.join(grace + 2 * _LINGER_SECONDS + 5)
  me = timeouts_lib.task_name(layout, layout.task_type, layout.task_id)
  head = (f"{me} waited {waited:.0f} s ({timeouts_lib.COLLECTIVE_ENV}) for "
          f"its peers at {what}")
  if "seen" not in result:
    leader = timeouts_lib.task_name(layout, *_leader(layout))
    return (f"{head}, and {leader}, which runs the cluster's coordination "
            f"service, did not answer either: it is frozen or unreachable.")
  return head + describe(layout, what, result["seen"])


def describe(layout, what, seen):
  """The part of a stuck report that names the other workers.

  Example:

  >>> describe(None, "train step 3", {("worker", 1): None})
  ': worker 1 did not join (alive: its heartbeats arrive, but it has not reached this step; busy or stuck outside it: a slow callback or data loading, a deadlock, a debugger).'
  """
  name = lambda task: timeouts_lib.task_name(layout, *task)  # pylint: disable=unnecessary-lambda-assignment
  missing = [name(t) for t, w in seen.items() if w is None]
  elsewhere = [f"{name(t)} waits in {w}" for t, w in seen.items()
               if w is not None and w != what]
  parts = []
  if missing:
    parts.append(
        f"{', '.join(missing)} did not join (alive: its heartbeats arrive, "
        f"but it has not reached this step; busy or stuck outside it: a "
        f"slow callback or data loading, a deadlock, a debugger)")
  if elsewhere:
    parts.append(
        f"{', '.join(elsewhere)}: the workers run different collectives. "
        f"Every worker must create the same tfpar strategies in the same "
        f"order (their collectives are numbered by creation order) and make "
        f"the same fit/evaluate/predict calls")
  if not parts:
    parts.append(
        "every worker waits in this step: a collective inside it differs "
        "between workers (a model or strategy built differently on one of "
        "them?)")
  return ": " + "; ".join(parts) + "."


def forwarded(message):
  """A peer's stuck report that TensorFlow passed on to this worker (the
  collective it aborted was one this worker waited in too), or None.

  Example:

  >>> forwarded("Collective ops is aborted by: worker 0 waited 15 s "
  ...           "(TFPAR_COLLECTIVE_TIMEOUT) for its peers at x: y.\\nmore")
  'worker 0 waited 15 s (TFPAR_COLLECTIVE_TIMEOUT) for its peers at x: y. (Reported by worker 0.)'
  """
  match = _FORWARDED.search(message)
  if match is None:
    return None
  reporter = match.group(1).split(" waited ")[0].split(" (")[0]
  return f"{match.group(1)} (Reported by {reporter}.)"


def explain(error, layout, timeouts):
  """A clear error naming the worker behind a collective failure, or None.

  Args:
    error: a `tf.errors.OpError` raised by a step.
    layout: this process's `ClusterLayout`.
    timeouts: the `Timeouts` in force.

  Example:

  >>> import tensorflow as tf
  >>> explain(tf.errors.UnavailableError(None, None,
  ...     "The following tasks are unhealthy (stopped sending heartbeats):\\n"
  ...     "/job:worker/replica:0/task:1\\nThe tasks have crashed."), None,
  ...     timeouts_lib.Timeouts()).message.splitlines()[0]
  'worker 1 stopped sending heartbeats for 10 s (TFPAR_HEARTBEAT_TIMEOUT): killed, stopped (SIGSTOP) or cut off from the network.'
  """
  text = _peer_gone(str(error), layout, timeouts)
  if text is None:
    return None
  first = str(error).strip().splitlines()
  tail = next((line for line in first if "aborted by" in line), first[0])
  return type(error)(error.node_def, error.op,
                     f"{text}\nTensorFlow's error: {tail.strip()}")


def _peer_gone(message, layout, timeouts):
  name = lambda task: timeouts_lib.task_name(layout, *task)  # pylint: disable=unnecessary-lambda-assignment
  heartbeat = f"{timeouts.heartbeat or 10:g} s ({timeouts_lib.HEARTBEAT_ENV})"
  _, found, after = message.partition("stopped sending heartbeats)")
  if found:
    tasks = timeouts_lib.tasks_named_in(after.split("\n\n")[0])
    return (f"{', '.join(map(name, tasks)) or 'A worker'} stopped sending "
            f"heartbeats for {heartbeat}: killed, stopped (SIGSTOP) or cut "
            f"off from the network.")
  if ("CoordinationService/Heartbeat" in message or
      "leader task was preempted" in message):
    return (f"{name(_leader(layout))}, which runs the cluster's coordination "
            f"service, stopped answering heartbeats for {heartbeat}: it "
            f"died, was stopped or cannot be reached.")
  _, found, after = message.partition("from remote target ")
  if found and any(sign in message.lower() for sign in (
      "connection reset", "connection refused", "socket closed",
      "failed to connect", "broken pipe")):
    tasks = timeouts_lib.tasks_named_in(after)
    if tasks:
      return (f"{name(tasks[0])} is gone: the connection to it was lost "
              f"(its process ended or its machine went away).")
  return None


def _leader(layout):
  if layout is not None and "chief" in layout.cluster_spec:
    return "chief", 0
  return "worker", 0
