"""`tfpar launch`: run a training script as several local `TF_CONFIG` workers.

Starts one process per worker with a correct `TF_CONFIG` on free ports of
the loopback interface, streams their output with a `[worker i]` prefix,
stops every worker as soon as one fails (and exits with its code), forwards
Ctrl-C, SIGTERM and SIGHUP, and stops everything after a timeout. A worker
that saved for a preemption and exited 143 (`tfpar.preemption`) leaves the
others, which save the same step, up to `PREEMPTED_GRACE_SECONDS` to exit
too. Workers never outlive the launcher, even when it is killed with
SIGKILL (see `tfpar.lifetime` and `tfpar.netns`). With `--recipe NAME` the
workers' `tfpar.from_recipe()` builds that recipe's strategy. With
`--elastic` a lost worker restarts the job on the workers left
(`tfpar.launch_elastic`); the processes are run by `tfpar.supervise`.
TensorFlow's start-up log is left out of the workers' output
(`tfpar.tf_startup_log`; `TFPAR_TF_LOGS=1` keeps it).
"""

import dataclasses
import json
import math
import os
import socket
import sys
import time

from tfpar import launch_elastic
from tfpar import netns
from tfpar import supervise
from tfpar import tf_startup_log
from tfpar.environment import DEVICES_PER_WORKER_ENV
from tfpar.ports import free_ports  # pylint: disable=unused-import
from tfpar.recipes import files as recipe_files

EXIT_TIMEOUT = supervise.EXIT_TIMEOUT
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = supervise.EXIT_PREEMPTED
PREEMPTED_GRACE_SECONDS = supervise.PREEMPTED_GRACE_SECONDS
_GRACE_SECONDS = supervise.GRACE_SECONDS


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
    elastic: when a worker is lost, stop the others and restart the job on
      the workers that are left (`tfpar.launch_elastic`).
    min_workers: with `elastic`, the fewest workers the job may run on
      (default: 1).
    max_restarts: with `elastic`, how many restarts are allowed (default 3).

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
  elastic: bool = False
  min_workers: int = None
  max_restarts: int = None

  def __post_init__(self):
    if self.isolate_network is None:
      object.__setattr__(self, "isolate_network",
                         self.host in _LOOPBACK)
    if not self.command:
      raise ValueError("tfpar launch needs a script to run. Received: none.")
    for name, least in (("workers", 1), ("devices_per_worker", 1),
                        ("min_workers", 1), ("max_restarts", 0)):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < least):
        kind = "a positive" if least else "a non-negative"
        raise ValueError(f"--{name.replace('_', '-')} must be {kind} "
                         f"integer. Received: {value!r}")
    _check_elastic(self)
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


def _check_elastic(config):
  """Refuses elastic settings that cannot apply; fills their defaults."""
  given = [f"--{name.replace('_', '-')}" for name in ("min_workers",
                                                      "max_restarts")
           if getattr(config, name) is not None]
  if not config.elastic:
    if given:
      raise ValueError(f"{' and '.join(given)} only apply with --elastic "
                       f"(restarts when a worker is lost). Received: "
                       f"{' and '.join(given)} without --elastic")
    return
  if config.min_workers is None:
    object.__setattr__(config, "min_workers", 1)
  if config.max_restarts is None:
    object.__setattr__(config, "max_restarts", 3)
  if config.min_workers > config.workers:
    raise ValueError(f"--min-workers must be at most --workers (the job "
                     f"starts on --workers and only loses workers). "
                     f"Received: --min-workers {config.min_workers}, "
                     f"--workers {config.workers}")


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
  deadline = None if config.timeout is None else (time.monotonic() +
                                                  config.timeout)
  if config.isolate_network:
    if netns.isolation_available():
      # The timeout is kept here, outside: the launcher inside stops on
      # SIGTERM.
      inner = dataclasses.replace(config, isolate_network=False, timeout=None)
      command = netns.UNSHARE + (sys.executable, "-m", "tfpar.launch",
                                 json.dumps(dataclasses.asdict(inner)))
      # The launcher inside stops its workers within _GRACE_SECONDS; after
      # that, killing `unshare` kills the whole namespace.
      return supervise.run([command], [dict(os.environ)], [""], deadline,
                           out, grace=_GRACE_SECONDS + 2).code
    out.write("tfpar launch: cannot make a private network namespace here; "
              "TensorFlow's worker servers will listen on all interfaces.\n")
  keep = tf_startup_log.LineFilter()
  if config.elastic:
    code = launch_elastic.run(
        config.workers, config.min_workers, config.max_restarts,
        lambda attempt: _run_workers(config, attempt.workers, deadline, out,
                                     keep, attempt.env, attempt.grace), out)
  else:
    code = _run_workers(config, config.workers, deadline, out, keep).code
  summary = keep.summary("tfpar launch")
  if summary:
    supervise.say(out, None, summary)
  return code


def _run_workers(config, workers, deadline, out, keep, extra_env=None,
                 grace=_GRACE_SECONDS):
  """Runs `workers` workers of `config` to the end; their `Outcome`
  (`keep`: which of their output lines to write)."""
  envs = []
  for tf_config in tf_configs(workers, config.host):
    env = dict(os.environ, **config.env, **(extra_env or {}),
               TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
    if config.devices_per_worker:
      env[DEVICES_PER_WORKER_ENV] = str(config.devices_per_worker)
    if config.recipe:
      env[recipe_files.RECIPE_ENV] = config.recipe  # The file's path.
    envs.append(env)
  prefixes = [f"[worker {index}] " for index in range(workers)]
  return supervise.run([config.command] * workers, envs, prefixes, deadline,
                       out, grace, keep)


if __name__ == "__main__":
  # Inside the private network namespace made by `launch`.
  netns.bring_loopback_up()
  _fields = json.loads(sys.argv[1])
  _fields["command"] = tuple(_fields["command"])
  sys.exit(launch(LaunchConfig(**_fields)))
