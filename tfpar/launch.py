"""`tfpar launch`: run a training script as several local `TF_CONFIG` workers.

Starts one process per worker with a correct `TF_CONFIG` on free ports of
the loopback interface, streams their output with a `[worker i]` prefix,
stops every worker as soon as one fails (and exits with its code), forwards
Ctrl-C, SIGTERM and SIGHUP, and stops everything after a timeout. A worker
that saved for a preemption and exited 143 (`tfpar.preemption`) leaves the
others, which save the same step, up to `PREEMPTED_GRACE_SECONDS` to exit
too. Workers never outlive the launcher, even when it is killed with
SIGKILL (see `tfpar.lifetime` and `tfpar.netns`). With `--recipe NAME` the
workers' `tfpar.from_recipe()` builds that recipe's strategy.
"""

import dataclasses
import json
import math
import os
import signal
import socket
import sys
import threading
import time

from tfpar import lifetime
from tfpar import netns
from tfpar.environment import DEVICES_PER_WORKER_ENV
from tfpar.ports import free_ports  # pylint: disable=unused-import
from tfpar.recipes import files as recipe_files

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
# tfpar.preemption.PREEMPTED_EXIT_CODE (the launcher does not import
# TensorFlow): the other workers get PREEMPTED_GRACE_SECONDS to exit too.
EXIT_PREEMPTED = 143
PREEMPTED_GRACE_SECONDS = 30.0
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
                         self.host in _LOOPBACK)
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
    _check_host(self.host, self.isolate_network)
    if self.timeout is not None and not 0 < self.timeout < math.inf:
      raise ValueError(
          f"--timeout must be positive seconds. Received: {self.timeout!r}")
    if self.recipe is not None:
      try:
        recipe = recipe_files.load(self.recipe)
      except ValueError as e:
        raise ValueError(f"--recipe {self.recipe!r}: {e}") from None
      object.__setattr__(self, "recipe", recipe.path)


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_host(host, isolate_network):
  """Refuses a --host the workers could not listen on or reach."""
  try:
    family, _, _, _, address = socket.getaddrinfo(
        host, None, type=socket.SOCK_STREAM)[0]
  except (socket.gaierror, UnicodeError) as e:
    raise ValueError(f"--host must be an IP address or a host name that "
                     f"resolves ({e}). Received: {host!r}") from None
  with socket.socket(family, socket.SOCK_STREAM) as sock:
    try:
      sock.bind((address[0], 0))
    except OSError as e:
      raise ValueError(f"--host must be an address of this machine, where "
                       f"the workers listen ({e.strerror}). Received: "
                       f"{host!r}") from None
  if isolate_network and host not in _LOOPBACK:
    raise ValueError(f"An isolated network has loopback only, so --host "
                     f"must be one of {list(_LOOPBACK)} (or pass "
                     f"--no-isolate-network). Received: {host!r}")


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
    124 after a timeout; 128 + the signal's number after SIGINT (130),
    SIGTERM (143) or SIGHUP (129). Every worker has stopped when it returns.

  Example:

  >>> import io
  >>> out = io.StringIO()
  >>> launch(LaunchConfig((sys.executable, "-c", "print('hi')"), workers=2),
  ...        out)
  0
  >>> sorted(out.getvalue().splitlines())  # The workers run side by side.
  ['[worker 0] hi', '[worker 1] hi']
  """
  out = out or sys.stdout
  if config.isolate_network:
    if netns.isolation_available():
      # The timeout is kept here, outside: the launcher inside stops on
      # SIGTERM.
      inner = dataclasses.replace(config, isolate_network=False, timeout=None)
      command = netns.UNSHARE + (sys.executable, "-m", "tfpar.launch",
                                 json.dumps(dataclasses.asdict(inner)))
      # The launcher inside stops its workers within _GRACE_SECONDS; after
      # that, killing `unshare` kills the whole namespace.
      return _run([command], [dict(os.environ)], [""], config.timeout, out,
                  grace=_GRACE_SECONDS + 2)
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


def _run(commands, envs, prefixes, timeout, out, grace=_GRACE_SECONDS):
  """Runs the processes to the end; returns the launcher's exit code."""
  lock = threading.Lock()
  deadline = None if timeout is None else time.monotonic() + timeout
  with lifetime.StopSignals() as stop:
    processes = []
    try:
      # Every process first, then the output threads: no thread runs while
      # `spawn` forks.
      for command, env in zip(commands, envs):
        processes.append(lifetime.spawn(command, env))
      pumps = [threading.Thread(target=_pump, daemon=True,
                                args=(process.stdout, prefix, out, lock))
               for process, prefix in zip(processes, prefixes)]
      for pump in pumps:
        pump.start()
      code = _supervise(processes, deadline, stop, out, lock)
    finally:
      lifetime.stop_all(processes, stop.received or signal.SIGTERM, grace)
    for pump in pumps:
      pump.join(timeout=_GRACE_SECONDS)
  return code


def _supervise(processes, deadline, stop, out, lock):
  failed = None  # The index of the first worker that failed.
  grace_end = None
  while True:
    if stop.received is not None:
      name = signal.Signals(stop.received).name
      _say(out, lock, f"tfpar launch: got {name}; stopping workers")
      return 128 + stop.received  # 130 for SIGINT, 143 for SIGTERM.
    codes = [p.poll() for p in processes]
    if failed is None:
      failed = next((index for index, code in enumerate(codes)
                     if code not in (None, 0)), None)
      if failed is not None and _saving(codes[failed], codes):
        _say(out, lock, f"tfpar launch: worker {failed} was preempted; "
             f"waiting up to {PREEMPTED_GRACE_SECONDS:.0f} s for the others "
             "to save and exit")
        grace_end = time.monotonic() + PREEMPTED_GRACE_SECONDS
    if failed is not None:
      code = codes[failed]
      if not (_saving(code, codes) and time.monotonic() < grace_end):
        if None in codes:
          _say(out, lock, f"tfpar launch: worker {failed} exited with code "
               f"{code}; stopping the other workers")
        return code if code > 0 else 128 - code
    elif all(code == 0 for code in codes):
      return 0
    if deadline is not None and time.monotonic() > deadline:
      _say(out, lock, "tfpar launch: timed out; stopping workers")
      return EXIT_TIMEOUT
    stop.wait(0.05)


def _saving(code, codes):
  """Whether a worker that exited with `code` was preempted while others,
  which save the same step (`tfpar.preemption`), still run."""
  return (code == EXIT_PREEMPTED and None in codes and
          all(other in (None, EXIT_PREEMPTED) for other in codes))


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
