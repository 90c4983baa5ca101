"""`tfpar launch`: TF_CONFIG, output prefixes, failures, timeout, Ctrl-C."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tfpar import cli
from tfpar import launch as launch_lib
from tfpar import ports as ports_lib


def _run_cli(*args, timeout=60):
  return subprocess.run([sys.executable, "-m", "tfpar", "launch", *args],
                        capture_output=True, text=True, timeout=timeout)


def _script(tmp_path, body):
  path = tmp_path / "script.py"
  path.write_text(body)
  return str(path)


def test_workers_get_a_valid_tf_config_and_prefixed_output(tmp_path):
  script = _script(tmp_path, (
      "import json, os, sys\n"
      "print(json.dumps([os.environ['TF_CONFIG'],"
      " os.environ.get('TFPAR_DEVICES_PER_WORKER'), sys.argv[1:]]))\n"))
  run = _run_cli("--workers", "3", "--devices-per-worker", "2", script,
                 "--flag", "value")
  assert run.returncode == 0, run.stdout + run.stderr
  seen = {}
  for line in run.stdout.splitlines():
    prefix, _, payload = line.partition("] ")
    tf_config, devices, argv = json.loads(payload)
    seen[prefix + "]"] = json.loads(tf_config)
    assert devices == "2" and argv == ["--flag", "value"]
  assert sorted(seen) == ["[worker 0]", "[worker 1]", "[worker 2]"]
  addresses = seen["[worker 0]"]["cluster"]["worker"]
  assert len(set(addresses)) == 3
  assert all(a.startswith("127.0.0.1:") for a in addresses)
  for index in range(3):
    config = seen[f"[worker {index}]"]
    assert config["task"] == {"type": "worker", "index": index}
    assert config["cluster"]["worker"] == addresses


def test_a_failing_worker_stops_the_others(tmp_path):
  script = _script(tmp_path, (
      "import json, os, sys, time\n"
      "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
      "if index == 1:\n"
      "  sys.exit(3)\n"
      "time.sleep(120)\n"))
  started = time.monotonic()
  run = _run_cli(script)
  assert run.returncode == 3
  assert "worker 1 exited with code 3; stopping the other workers" in run.stdout
  assert time.monotonic() - started < 60


def test_timeout_stops_every_worker(tmp_path):
  script = _script(tmp_path, "import time\nprint('up', flush=True)\n"
                   "time.sleep(120)\n")
  run = _run_cli("--timeout", "3", script)
  assert run.returncode == launch_lib.EXIT_TIMEOUT
  assert "timed out" in run.stdout


def test_ctrl_c_is_forwarded_to_the_workers(tmp_path):
  marker = tmp_path / "stopped"
  script = _script(tmp_path, (
      "import json, os, signal, sys, time\n"
      "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
      "def on_sigint(*_):\n"
      f"  open(r'{marker}' + str(index), 'w').close()\n"
      "  sys.exit(1)\n"
      "signal.signal(signal.SIGINT, on_sigint)\n"
      "print('ready', flush=True)\n"
      "time.sleep(120)\n"))
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tfpar", "launch", "--timeout", "60", script],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  ready = 0
  while ready < 2:
    line = launcher.stdout.readline()
    assert line, "launcher ended early"
    ready += line.rstrip().endswith("ready")
  launcher.send_signal(signal.SIGINT)
  assert launcher.wait(timeout=30) == launch_lib.EXIT_INTERRUPTED
  assert os.path.exists(f"{marker}0") and os.path.exists(f"{marker}1")


@pytest.mark.skipif(not launch_lib.netns.isolation_available(),
                    reason="no unprivileged network namespaces here")
def test_worker_servers_are_not_reachable_from_outside(tmp_path):
  """A worker listening on every interface, as TF's gRPC server does."""
  script = _script(tmp_path, (
      "import socket, time\n"
      "server = socket.socket()\n"
      "server.bind(('0.0.0.0', 0))\n"
      "server.listen()\n"
      "print('port', server.getsockname()[1], flush=True)\n"
      "time.sleep(120)\n"))
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tfpar", "launch", "--workers", "1", "--timeout",
       "60", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  try:
    port = int(launcher.stdout.readline().split()[-1])
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection(("127.0.0.1", port), timeout=5)
  finally:
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=30)


@pytest.mark.parametrize("args, message", [
    (["--workers", "0", "x.py"], "--workers must be a positive integer"),
    (["--devices-per-worker", "-2", "x.py"],
     "--devices-per-worker must be a positive integer"),
    (["--timeout", "0", "x.py"], "--timeout must be positive"),
    (["--host", "127.0.0.1:99", "x.py"],
     "--host takes an address without a port"),
    (["/no/such/train.py"], "the script '/no/such/train.py' does not exist"),
    (["-m", "no_such_module_x.train"],
     "the module 'no_such_module_x.train' (--module) is not importable"),
    (["--host", "no-such-host.invalid", "x.py"],
     "--host must be an IP address or a host name that resolves"),
    (["--host", "192.0.2.1", "--no-isolate-network", "x.py"],
     "--host must be an address of this machine"),
    (["--timeout", "nan", "x.py"], "--timeout must be positive seconds. "
     "Received: nan"),
])
def test_bad_arguments_are_reported(args, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["launch", *args])
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_tf_configs_and_free_ports():
  configs = [json.loads(c) for c in launch_lib.tf_configs(2, ports=[5, 6])]
  assert configs[1] == {"cluster": {"worker": ["127.0.0.1:5", "127.0.0.1:6"]},
                        "task": {"type": "worker", "index": 1}}
  ports = launch_lib.free_ports(4)
  assert len(set(ports)) == 4
  # Below the range the kernel takes outgoing connections' ports from, so a
  # worker's connection cannot take a peer's port before it listens.
  first, _ = ports_lib.ephemeral_range()
  if first > 20000:
    assert all(20000 <= port < first for port in ports), (ports, first)
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", ports[0]))


def test_isolated_network_needs_a_loopback_host():
  with pytest.raises(ValueError, match=r"isolated network has loopback only.*"
                     r"Received: '0.0.0.0'"):
    launch_lib.LaunchConfig(("x.py",), host="0.0.0.0", isolate_network=True)
  config = launch_lib.LaunchConfig(("x.py",), host="0.0.0.0")
  assert not config.isolate_network
