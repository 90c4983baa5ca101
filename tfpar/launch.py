"""`tfpar launch`: run a training script as several local `TF_CONFIG` workers.

Starts one process per worker with a correct `TF_CONFIG` on free ports of
the loopback interface, streams their output with a `[worker i]` prefix,
stops every worker as soon as one fails (and exits with its code), forwards
Ctrl-C, and stops everything after a timeout. With `--recipe NAME` the
workers' `tfpar.from_recipe()` builds that recipe's strategy.
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

from tfpar import netns
from tfpar.recipes import files as recipe_files

# Read by tfpar.local_devices in each worker (kept here so that the launcher
# does not import TensorFlow).
DEVICES_PER_WORKER_ENV = "TFPAR_DEVICES_PER_WORKER"
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
    isolate_network: run the workers in a private loopback-only network
      namespace (default: when `host` is a loopback address), because
      TensorFlow's servers listen on every interface.
    recipe: a recipe name (`tfpar.recipes.available()`) or `.toml` path for
      `tfpar.from_recipe()` in the workers (None: none). It is checked
      here, before any worker starts, and kept as the file's absolute path,
      which the workers get in `TFPAR_RECIPE`.

  Example:

  >>> config = LaunchConfig(("python", "train.py"), recipe="zero2")
  >>> config.recipe  # doctest: +SKIP
  '/src/tfpar/strategies/zero2.toml'
  """

  command: tuple
  workers: int = 2
  devices_per_worker: int = None
  host: str = "127.0.0.1"
  timeout: float = None
  env: dict = dataclasses.field(default_factory=dict)
  isolate_network: bool = None
  recipe: str = None

  def __post_init__(self):
    if self.isolate_network is None:
      object.__setattr__(self, "isolate_network",
                         self.host in ("127.0.0.1", "localhost", "::1"))
    if not self.command:
      raise ValueError("tfpar launch needs a script to run. Received: none.")
    for name in ("workers", "devices_per_worker"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"--{name.replace('_', '-')} must be a positive "
                         f"integer. Received: {value!r}")
    if self.host.count(":") == 1 or not self.host.strip():
      raise ValueError(
          f"--host takes an address without a port (tfpar launch picks "
          f"free ports itself), e.g. 127.0.0.1 or ::1. Received: "
          f"{self.host!r}")
    if self.timeout is not None and self.timeout <= 0:
      raise ValueError(
          f"--timeout must be positive seconds. Received: {self.timeout!r}")
    if self.recipe is not None:
      try:
        recipe = recipe_files.load(self.recipe)
      except ValueError as e:
        raise ValueError(f"--recipe {self.recipe!r}: {e}") from None
      object.__setattr__(self, "recipe", recipe.path)


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
  if config.isolate_network:
    if netns.isolation_available():
      inner = dataclasses.replace(config, isolate_network=False)
      command = netns.UNSHARE + (sys.executable, "-m", "tfpar.launch",
                                 json.dumps(dataclasses.asdict(inner)))
      return _run([command], [dict(os.environ)], [""], config.timeout, out)
    out.write("tfpar launch: cannot make a private network namespace here; "
              "TensorFlow's worker servers will listen on all interfaces.\n")
  envs = []
  for tf_config in tf_configs(config.workers, config.host):
    env = dict(os.environ, **config.env, TF_CONFIG=tf_config,
               PYTHONUNBUFFERED="1")
    if config.devices_per_worker:
      env[DEVICES_PER_WORKER_ENV] = str(config.devices_per_worker)
    if config.recipe:
      env[recipe_files.RECIPE_ENV] = config.recipe  # The file's path.
    envs.append(env)
  prefixes = [f"[worker {index}] " for index in range(config.workers)]
  return _run([config.command] * config.workers, envs, prefixes,
              config.timeout, out)


def _run(commands, envs, prefixes, timeout, out):
  """Runs the processes to the end; returns the launcher's exit code."""
  lock = threading.Lock()
  processes, pumps = [], []
  for command, env, prefix in zip(commands, envs, prefixes):
    process = subprocess.Popen(
        list(command), env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    processes.append(process)
    pump = threading.Thread(target=_pump, daemon=True,
                            args=(process.stdout, prefix, out, lock))
    pump.start()
    pumps.append(pump)

  deadline = None if timeout is None else time.monotonic() + timeout
  on_main_thread = threading.current_thread() is threading.main_thread()
  previous_sigint = signal.getsignal(signal.SIGINT)
  interrupted = threading.Event()
  if on_main_thread:
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
  try:
    code = _supervise(processes, deadline, interrupted, out, lock)
  finally:
    _stop_all(processes,
              signal.SIGINT if interrupted.is_set() else signal.SIGTERM)
    if on_main_thread:
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
        if len(processes) > 1:
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


if __name__ == "__main__":
  # Inside the private network namespace made by `launch`.
  netns.bring_loopback_up()
  _fields = json.loads(sys.argv[1])
  _fields["command"] = tuple(_fields["command"])
  sys.exit(launch(LaunchConfig(**_fields)))
