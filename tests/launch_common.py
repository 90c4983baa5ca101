"""`tfpar launch` of a worker script on `TF_CONFIG` workers (real
processes on loopback ports), as the multi-worker tests run it."""

import subprocess
import sys


def launch(script, *args, workers=2, devices_per_worker=2, timeout=300,
           **kwargs):
  """The `subprocess.CompletedProcess` of `tfpar launch` running
  `script *args` on `workers` workers; the launcher stops them after
  `timeout` seconds, and this call gives up 60 s later.

  Args:
    script: the worker script.
    *args: its arguments (converted to strings).
    workers: the number of workers.
    devices_per_worker: virtual CPUs per worker.
    timeout: the launcher's `--timeout`, seconds.
    **kwargs: passed to `subprocess.run` (`env`, ...).
  """
  command = [sys.executable, "-m", "tfpar", "launch", "--workers",
             str(workers), "--devices-per-worker", str(devices_per_worker),
             "--timeout", str(timeout), str(script), *map(str, args)]
  return subprocess.run(command, capture_output=True, text=True,
                        timeout=timeout + 60, **kwargs)


def launch_ok(script, *args, **kwargs):
  """`launch`, asserting that it exited 0 (its output's tails if not)."""
  run = launch(script, *args, **kwargs)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
  return run
