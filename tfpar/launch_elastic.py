"""`tfpar launch --elastic`: keep a job running when workers go away.

When a worker dies (its process ends with a failure, is killed, or its
machine goes away) the launcher stops the other workers at once, and
starts the job again on the workers that are left, with a new `TF_CONFIG`
for that many workers. The script resumes from its last backup
(`tfpar.BackupAndRestore`), which holds whole weights and optimizer state
and so loads on any number of workers; `tfpar.keep_global_batch` keeps
the global batch. A preemption (every worker saved and exited 143)
restarts the job without the workers that got the SIGTERM.

The launcher gives up, with the last failure's exit code and a line that
says why, when fewer than `min_workers` workers would be left or after
`max_restarts` restarts.

No TensorFlow here: the launcher must start fast.
"""

import dataclasses
import os
import shutil
import tempfile
import time

from tfpar import supervise
from tfpar.environment import ELASTIC_RESTART_ENV as RESTART_ENV
# A worker preempted by SIGTERM leaves `preempted.<index>` in this folder
# (tfpar.preemption), so that the restart leaves its machine out.
from tfpar.environment import ELASTIC_STATE_DIR_ENV as STATE_DIR_ENV
# Survivors of a lost worker cannot finish a step (their collectives wait
# for the lost one): they get this long to end a write in progress, then
# SIGKILL.
STOP_GRACE_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One run of the job, as the restart loop sees it.

  Attributes:
    workers: how many workers it ran on.
    restart: 0 for the first run, then 1, 2, ...
    env: extra environment for every worker (restart count, state dir).
    grace: seconds between SIGTERM and SIGKILL when stopping workers.
  """

  workers: int
  restart: int
  env: dict
  grace: float = STOP_GRACE_SECONDS


def preempted_workers(state_dir):
  """Indices of the workers that left a preemption mark in `state_dir`.

  Example:

  >>> import tempfile
  >>> folder = tempfile.mkdtemp()
  >>> open(os.path.join(folder, "preempted.2"), "w").close()
  >>> preempted_workers(folder)
  (2,)
  """
  found = []
  for name in os.listdir(state_dir):
    prefix, _, index = name.partition(".")
    if prefix == "preempted" and index.isdigit():
      found.append(int(index))
  return tuple(sorted(found))


def _lost(outcome, state_dir):
  """The workers the restart leaves out, and why (for the log)."""
  if all(code == supervise.EXIT_PREEMPTED for code in outcome.codes):
    preempted = preempted_workers(state_dir)
    return preempted, (f"worker(s) {list(preempted)} preempted (SIGTERM)"
                       if preempted else "the job was preempted")
  described = ", ".join(f"worker {index} ({_describe(outcome.codes[index])})"
                        for index in outcome.failed)
  return outcome.failed, f"lost {described}"


def _describe(code):
  if code is not None and code < 0:
    return f"killed by signal {-code}"
  return f"exit code {code}"


def run(workers, min_workers, max_restarts, run_attempt, out):
  """Runs the job, restarting it on the workers left after each loss.

  Args:
    workers: the number of workers of the first run.
    min_workers: the fewest workers the job may run on.
    max_restarts: how many restarts are allowed.
    run_attempt: a function of an `Attempt` that runs it and returns its
      `tfpar.supervise.Outcome`.
    out: where the launcher's lines go.

  Returns:
    0 when a run ends with every worker done; else the exit code of the
    run that ended the job (a signal's, the timeout's, or the failure's
    when the launcher gives up).

  Example:

  >>> import io
  >>> codes = iter([supervise.Outcome(9, failed=(1,), codes=(-9, 9, -9)),
  ...               supervise.Outcome(0)])
  >>> out = io.StringIO()
  >>> run(3, 2, 1, lambda attempt: next(codes), out)
  0
  >>> print(out.getvalue().strip())  # doctest: +ELLIPSIS
  tfpar launch: lost worker 1 (exit code 9); restarting on 2 workers from the last backup (restart 1 of 1, at least 2 workers)
  """
  state_dir = tempfile.mkdtemp(prefix="tfpar_elastic_")
  try:
    restart = 0
    while True:
      outcome = run_attempt(Attempt(workers, restart, {
          RESTART_ENV: str(restart), STATE_DIR_ENV: state_dir}))
      if outcome.code == 0 or outcome.stopped:
        return outcome.code
      lost, why = _lost(outcome, state_dir)
      for name in os.listdir(state_dir):
        os.remove(os.path.join(state_dir, name))
      left = workers - len(lost)
      if left < min_workers:
        supervise.say(out, None, f"tfpar launch: {why}; giving up: {left} "
                      f"worker(s) left, fewer than --min-workers "
                      f"{min_workers}")
        return outcome.code
      if restart >= max_restarts:
        supervise.say(out, None, f"tfpar launch: {why}; giving up: the "
                      f"restart budget (--max-restarts {max_restarts}) is "
                      "spent")
        return outcome.code
      restart += 1
      stopping = (f"; the others stopped in "
                  f"{time.monotonic() - outcome.seen:.1f} s"
                  if outcome.seen else "")
      supervise.say(out, None, f"tfpar launch: {why}{stopping}; restarting "
                    f"on {left} workers from the last backup (restart "
                    f"{restart} of {max_restarts}, at least {min_workers} "
                    "workers)")
      workers = left
  finally:
    shutil.rmtree(state_dir, ignore_errors=True)
