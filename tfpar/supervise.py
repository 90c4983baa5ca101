"""Running a set of worker processes to their end, for `tfpar launch`.

`run` starts the processes (`tfpar.lifetime.spawn`), streams their output
with a prefix each, and watches them: the first worker that fails ends the
run (the others are stopped), a worker that saved for a preemption and
exited 143 leaves the others `PREEMPTED_GRACE_SECONDS` to save the same
step, and Ctrl-C / SIGTERM / SIGHUP or the deadline stop everything.

No TensorFlow here: the launcher must start fast.
"""

import dataclasses
import signal
import threading
import time

from tfpar import lifetime

EXIT_TIMEOUT = 124
# tfpar.preemption.PREEMPTED_EXIT_CODE (the launcher does not import
# TensorFlow): the other workers get PREEMPTED_GRACE_SECONDS to exit too.
EXIT_PREEMPTED = 143
PREEMPTED_GRACE_SECONDS = 30.0
GRACE_SECONDS = 5.0


@dataclasses.dataclass
class Outcome:
  """How a run of workers ended.

  Attributes:
    code: the launcher's exit code (0, the first failing worker's code, 124
      after the deadline, 128 + a signal's number).
    failed: the indices of the workers that had failed when the first
      failure was seen (the others were stopped by the launcher).
    stopped: "signal" or "timeout" when the launcher stopped the run
      itself, else None.
    codes: every worker's exit code once all were stopped.
    seen: the `time.monotonic()` at which the first failure was seen
      (None: no failure).
  """

  code: int
  failed: tuple = ()
  stopped: str = None
  codes: tuple = ()
  seen: float = None


def run(commands, envs, prefixes, deadline, out, grace=GRACE_SECONDS,
        keep=None):
  """Runs one process per command to the end; returns an `Outcome`.

  Args:
    commands: each process's program and arguments.
    envs: each process's whole environment.
    prefixes: each process's output prefix.
    deadline: a `time.monotonic()` time after which everything is stopped
      (None: no limit).
    out: where the output goes.
    grace: seconds between the polite signal and SIGKILL when stopping.
    keep: which output lines to write (`keep(line)`; None: every line).

  Example:

  >>> import io, sys
  >>> out = io.StringIO()
  >>> run([(sys.executable, "-c", "print(1)")], [None], ["[w] "], None,
  ...     out).code, out.getvalue()
  (0, '[w] 1\\n')
  """
  lock = threading.Lock()
  pumps = []
  with lifetime.StopSignals() as stop:
    processes = []
    try:
      # Every process first, then the output threads: no thread runs while
      # `spawn` forks.
      for command, env in zip(commands, envs):
        processes.append(lifetime.spawn(command, env))
      pumps = [threading.Thread(target=_pump, daemon=True,
                                args=(process.stdout, prefix, out, lock,
                                      keep))
               for process, prefix in zip(processes, prefixes)]
      for pump in pumps:
        pump.start()
      outcome = _supervise(processes, deadline, stop, out, lock)
    finally:
      lifetime.stop_all(processes, stop.received or signal.SIGTERM, grace)
    for pump in pumps:
      pump.join(timeout=GRACE_SECONDS)
  outcome.codes = tuple(process.returncode for process in processes)
  return outcome


def _supervise(processes, deadline, stop, out, lock):
  failed = None  # The indices of the first workers that failed.
  grace_end = None
  while True:
    if stop.received is not None:
      name = signal.Signals(stop.received).name
      say(out, lock, f"tfpar launch: got {name}; stopping workers")
      # 130 for SIGINT, 143 for SIGTERM.
      return Outcome(128 + stop.received, stopped="signal")
    codes = [p.poll() for p in processes]
    if failed is None:
      failed = tuple(index for index, code in enumerate(codes)
                     if code not in (None, 0)) or None
      seen = time.monotonic()
      if failed is not None and _saving(codes[failed[0]], codes):
        say(out, lock, f"tfpar launch: worker {failed[0]} was preempted; "
            f"waiting up to {PREEMPTED_GRACE_SECONDS:.0f} s for the others "
            "to save and exit")
        grace_end = time.monotonic() + PREEMPTED_GRACE_SECONDS
    if failed is not None:
      code = codes[failed[0]]
      if not (_saving(code, codes) and time.monotonic() < grace_end):
        if None in codes:
          say(out, lock, f"tfpar launch: worker {failed[0]} exited with "
              f"code {code}; stopping the other workers")
        return Outcome(code if code > 0 else 128 - code, failed=failed,
                       seen=seen)
    elif all(code == 0 for code in codes):
      return Outcome(0)
    if deadline is not None and time.monotonic() > deadline:
      say(out, lock, "tfpar launch: timed out; stopping workers")
      return Outcome(EXIT_TIMEOUT, stopped="timeout")
    stop.wait(0.05)


def _saving(code, codes):
  """Whether a worker that exited with `code` was preempted while others,
  which save the same step (`tfpar.preemption`), still run."""
  return (code == EXIT_PREEMPTED and None in codes and
          all(other in (None, EXIT_PREEMPTED) for other in codes))


def _pump(stream, prefix, out, lock, keep):
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", "replace").rstrip("\n")
    if keep is None or keep(line):
      say(out, lock, prefix + line)
  stream.close()


def say(out, lock, line):
  """Writes `line` to `out` under `lock` (None: no other writer)."""
  if lock is None:
    out.write(line + "\n")
    out.flush()
    return
  with lock:
    say(out, None, line)
