"""`tfpar launch` leaves no worker behind, however it ends, in both modes.

Each case starts `tfpar launch` on a script that sleeps, ends it (its own
--timeout, SIGTERM or SIGKILL to the launcher, a failing worker) and checks
that within 15 s no process carrying this test's marker (the launcher, the
namespace wrapper, the workers) is alive. The measured time from the end to
the last process gone is printed (`pytest -s`).
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tfpar import launch as launch_lib

_MARKER_ENV = "TFPAR_CLEANUP_TEST_MARKER"
_LIMIT_SECONDS = 15.0

_MODES = ["isolated", "no-isolate"]
if not launch_lib.netns.isolation_available():
  _MODES.remove("isolated")

# Workers that ignore SIGTERM, as TensorFlow's preemption notifier does; the
# launcher then has to escalate to SIGKILL.
_SCRIPT = """\
import json, os, signal, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if {ignore_sigterm}:
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
if {fail} and index == 1:
  time.sleep(0.5)
  sys.exit(3)
time.sleep(120)
"""


def _marked_processes(marker):
  """{pid: has TF_CONFIG} of the live processes whose environment has marker."""
  needle = f"{_MARKER_ENV}={marker}\0".encode()
  found = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        environ = f.read()
    except OSError:  # Gone, or not ours.
      continue
    if needle in environ:  # A zombie's environ reads as empty.
      found[int(name)] = b"\0TF_CONFIG=" in b"\0" + environ
  return found


def _wait_until_gone(marker, seconds):
  """Seconds until no marked process is left (or None after `seconds`)."""
  start = time.monotonic()
  while time.monotonic() - start < seconds:
    if not _marked_processes(marker):
      return time.monotonic() - start
    time.sleep(0.05)
  return None


def _kill_marked(marker):
  for pid in _marked_processes(marker):
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("ending", ["timeout", "SIGTERM", "SIGKILL",
                                    "worker-fails"])
def test_no_worker_outlives_the_launcher(ending, mode, tmp_path):
  script = tmp_path / "sleeper.py"
  script.write_text(_SCRIPT.format(ignore_sigterm=ending == "SIGTERM",
                                   fail=ending == "worker-fails"))
  marker = uuid.uuid4().hex
  args = [sys.executable, "-m", "tfpar", "launch", "--workers", "2"]
  if mode == "no-isolate":
    args.append("--no-isolate-network")
  if ending == "timeout":
    args += ["--timeout", "3"]
  launcher = subprocess.Popen(
      args + [str(script)], env=dict(os.environ, **{_MARKER_ENV: marker}),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    ready = 0
    while ready < 2:
      line = launcher.stdout.readline()
      assert line, "the launcher ended before its workers were ready"
      ready += line.rstrip().endswith("ready")
    workers = [pid for pid, is_worker in _marked_processes(marker).items()
               if is_worker]
    assert len(workers) == 2, _marked_processes(marker)
    if ending in ("SIGTERM", "SIGKILL"):
      launcher.send_signal(getattr(signal, ending))
    else:  # The end is announced by the launcher.
      expected = ("timed out" if ending == "timeout"
                  else "worker 1 exited with code 3")
      for line in launcher.stdout:
        if expected in line:
          break
      else:
        pytest.fail(f"the launcher never said {expected!r}")
    ended = time.monotonic()
    code = launcher.wait(timeout=_LIMIT_SECONDS)
    left = _LIMIT_SECONDS - (time.monotonic() - ended)
    gone = _wait_until_gone(marker, max(left, 0.0))
    assert gone is not None, (
        f"processes left {_LIMIT_SECONDS} s after {ending} ({mode}): "
        f"{_marked_processes(marker)}")
    cleanup = time.monotonic() - ended
    print(f"\ncleanup after {ending} ({mode}): {cleanup:.2f} s, "
          f"launcher exit code {code}")
    assert code == {"timeout": launch_lib.EXIT_TIMEOUT, "SIGTERM": 143,
                    "SIGKILL": -signal.SIGKILL, "worker-fails": 3}[ending]
  finally:
    launcher.kill()
    launcher.wait()
    _kill_marked(marker)
