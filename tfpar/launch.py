"""`tfpar launch`: run a training script as several local `TF_CONFIG` workers.

Starts one process per worker with a correct `TF_CONFIG` on free ports of
the loopback interface, streams their output with a `[worker i]` prefix,
stops every worker as soon as one fails (and exits with its code), forwards
Ctrl-C, and stops everything after a timeout.
"""

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfpar import local_devices

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
_GRACE_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """What `tfpar launch` runs.

  Attributes:
    command: the program and its arguments, e.g. `[sys.executable, "t.py"]`.
    workers: number of worker processes, at least 1.
    devices_per_worker: virtual CPUs per worker on a CPU-only host (None:
      leave TensorFlow's default).
    host: the address workers listen on and dial; loopback by default.
    timeout: seconds before every worker is stopped (None: no limit).
    env: extra environment variables for every worker.
  """

  command: tuple
  workers: int = 2
  devices_per_worker: int = None
  host: str = "127.0.0.1"
  timeout: float = None
  env: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.command:
      raise ValueError("tfpar launch needs a script to run. Received: none.")
    for name in ("workers", "devices_per_worker"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"--{name.replace('_', '-')} must be a positive "
                         f"integer. Received: {value!r}")
    if self.timeout is not None and self.timeout <= 0:
      raise ValueError(
          f"--timeout must be positive seconds. Received: {self.timeout!r}")


def free_ports(count, host="127.0.0.1"):
  """Returns `count` distinct ports that are free on `host` right now."""
  with contextlib.ExitStack() as stack:
    ports = []
    for _ in range(count):
      sock = stack.enter_context(socket.socket(
          socket.AF_INET6 if ":" in host else socket.AF_INET,
          socket.SOCK_STREAM))
      sock.bind((host, 0))
      ports.append(sock.getsockname()[1])
    return ports


def tf_configs(workers, host="127.0.0.1", ports=None):
  """The `TF_CONFIG` JSON text of each of `workers` local workers.

  Example:

  >>> json.loads(tf_configs(2, ports=[2222, 2223])[1])["task"]
  {'type': 'worker', 'index': 1}
  """
  ports = ports or free_ports(workers, host)
  netloc = f"[{host}]" if ":" in host else host
  cluster = {"worker": [f"{netloc}:{port}" for port in ports]}
  return [json.dumps({"cluster": cluster,
                      "task": {"type": "worker", "index": index}})
          for index in range(workers)]


def launch(config, out=None):
  """Runs `config.command` as `config.workers` workers; returns an exit code.

  Args:
    config: a `LaunchConfig`.
    out: where worker output goes (default `sys.stdout`).

  Returns:
    0 when every worker succeeded; the first failing worker's exit code;
    124 after a timeout; 130 after Ctrl-C.

  Example:

  >>> launch(LaunchConfig((sys.executable, "-c", "print('hi')"), workers=2))
  [worker 0] hi
  [worker 1] hi
  0
  """
  out = out or sys.stdout
  lock = threading.Lock()
  processes, pumps = [], []
  for index, tf_config in enumerate(tf_configs(config.workers, config.host)):
    env = dict(os.environ, **config.env, TF_CONFIG=tf_config,
               PYTHONUNBUFFERED="1")
    if config.devices_per_worker:
      env[local_devices.DEVICES_PER_WORKER_ENV] = str(config.devices_per_worker)
    process = subprocess.Popen(
        list(config.command), env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    processes.append(process)
    pump = threading.Thread(target=_pump, daemon=True,
                            args=(process.stdout, f"[worker {index}] ", out, lock))
    pump.start()
    pumps.append(pump)

  deadline = None if config.timeout is None else time.monotonic() + config.timeout
  previous_sigint = signal.getsignal(signal.SIGINT)
  interrupted = threading.Event()
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
  try:
    code = _supervise(processes, deadline, interrupted, out, lock)
  finally:
    _stop_all(processes, signal.SIGINT if interrupted.is_set() else signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGINT, previous_sigint)
    for pump in pumps:
      pump.join(timeout=_GRACE_SECONDS)
  return code


def _supervise(processes, deadline, interrupted, out, lock):
  while True:
    if interrupted.is_set():
      _say(out, lock, "tfpar launch: interrupted; stopping workers")
      return EXIT_INTERRUPTED
    codes = [p.poll() for p in processes]
    for index, code in enumerate(codes):
      if code not in (None, 0):
        _say(out, lock, f"tfpar launch: worker {index} exited with code "
             f"{code}; stopping the other workers")
        return code if code > 0 else 128 - code
    if all(code == 0 for code in codes):
      return 0
    if deadline is not None and time.monotonic() > deadline:
      _say(out, lock, "tfpar launch: timed out; stopping workers")
      return EXIT_TIMEOUT
    time.sleep(0.05)


def _stop_all(processes, first_signal):
  for process in processes:
    _signal_group(process, first_signal)
  deadline = time.monotonic() + _GRACE_SECONDS
  for process in processes:
    try:
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for process in processes:
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process, sig):
  # Each worker leads its own process group, so its children stop too.
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(process.pid, sig)


def _pump(stream, prefix, out, lock):
  for raw in iter(stream.readline, b""):
    _say(out, lock, prefix + raw.decode("utf-8", "replace").rstrip("\n"))
  stream.close()


def _say(out, lock, line):
  with lock:
    out.write(line + "\n")
    out.flush()
