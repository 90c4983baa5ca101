"""Bounded waits: every way a multi-worker job used to hang fails in bounded
time, on the surviving workers, naming the worker it waited for.

Real worker processes (tests/workers/hang_worker.py, 2 workers x 2 virtual
CPUs on 127.0.0.1) run every scenario at once, with short limits; each test
checks one scenario's errors and the time they took, measured from the
event that started the wait (printed with wall-clock times by the workers).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tfpar import peer_report
from tfpar import ports
from tfpar import timeouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "hang_worker.py")
CONNECT = 10.0  # Connect timeout where a peer never starts.
COLLECTIVE = 15.0
HEARTBEAT = 10.0  # TensorFlow's default, set explicitly.
GRACE = peer_report.grace_seconds(COLLECTIVE)
SLACK = 15.0  # For a loaded machine.
DEADLINE = 170.0  # For the whole module's processes.

# Scenario: (worker script argument, tasks started, tasks that must end).
SCENARIOS = {
    "peer-never-starts": ("connect", (0,), (0,)),
    "chief-never-starts": ("connect", (1,), (1,)),
    "sleep": ("sleep", (0, 1), (0,)),
    "stop": ("stop", (0, 1), (0,)),
    "chief-dies": ("chief-dies", (0, 1), (0, 1)),
    "extra-strategy": ("extra-strategy", (0, 1), (0, 1)),
    "save-skipped": ("save-skipped", (0, 1), (0,)),
}


def _environment(tf_config, connect):
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  env.update(TF_CONFIG=json.dumps(tf_config), PYTHONUNBUFFERED="1",
             TFPAR_DEVICES_PER_WORKER="2",
             PYTHONPATH=os.pathsep.join(
                 [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  env[timeouts.CONNECT_ENV] = str(connect)
  env[timeouts.COLLECTIVE_ENV] = str(COLLECTIVE)
  env[timeouts.HEARTBEAT_ENV] = str(HEARTBEAT)
  return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Runs every scenario at once; returns {scenario: {task: events}} and
  each scenario's addresses."""
  directory = tmp_path_factory.mktemp("hangs")
  free = iter(ports.free_ports(2 * len(SCENARIOS)))  # Distinct, in one go.
  started, results = {}, {}
  try:
    for name, (argument, tasks, _) in SCENARIOS.items():
      addresses = [f"127.0.0.1:{next(free)}" for _ in range(2)]
      results[name] = {"addresses": addresses, "events": {}}
      connect = CONNECT if argument == "connect" else 120
      for task in tasks:
        config = {"cluster": {"worker": addresses},
                  "task": {"type": "worker", "index": task}}
        log = open(directory / f"{name}.{task}.log", "w+")
        env = _environment(config, connect)
        env["HANG_DIR"] = str(directory)
        started[name, task] = (subprocess.Popen(
            [sys.executable, WORKER, argument], stdout=log,
            stderr=subprocess.STDOUT, env=env,
            start_new_session=True), log)
    end = time.monotonic() + DEADLINE
    for (name, task), (process, _) in started.items():
      if task in SCENARIOS[name][2]:
        try:
          process.wait(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
          pass
  finally:
    for process, log in started.values():
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)  # Stopped ones too.
      process.wait()
      log.close()
  for (name, task), (process, log) in started.items():
    with open(log.name) as f:
      text = f.read()
    results[name]["events"][task] = {
        e["event"]: e for e in (json.loads(line[6:]) for line in
                                text.splitlines() if line.startswith("EVENT "))}
    results[name]["events"][task]["log"] = text[-3000:]
  return results


def _error(run, task):
  events = run["events"][task]
  assert "error" in events, events["log"]
  return events["error"]


def _seconds(run, since, task):
  """Seconds from event `since` = (task, event) to `task`'s error."""
  start = run["events"][since[0]][since[1]]["time"]
  return _error(run, task)["time"] - start


def test_a_peer_that_never_starts_is_named(runs):
  run = runs["peer-never-starts"]
  error = _error(run, 0)
  assert error["type"] == "DeadlineExceededError"
  assert (f"worker 1 ({run['addresses'][1]}) did not connect to the cluster "
          f"within 10 s (TFPAR_CONNECT_TIMEOUT)") in error["message"]
  seconds = _seconds(run, (0, "strategy"), 0)
  print(f"peer never starts: error after {seconds:.1f} s")
  assert CONNECT <= seconds <= CONNECT + SLACK


def test_a_chief_that_never_starts_is_named(runs):
  run = runs["chief-never-starts"]
  error = _error(run, 1)
  assert error["type"] == "DeadlineExceededError"
  assert (f"worker 0 ({run['addresses'][0]}), which runs the cluster's "
          f"coordination service, did not answer worker 1") in error["message"]
  seconds = _seconds(run, (1, "strategy"), 1)
  print(f"chief never starts: error after {seconds:.1f} s")
  assert CONNECT <= seconds <= CONNECT + SLACK


def test_a_worker_stuck_outside_the_step_is_named(runs):
  run = runs["sleep"]
  error = _error(run, 0)
  assert error["type"] == "DeadlineExceededError"
  assert (f"worker 0 ({run['addresses'][0]}) waited 15 s "
          f"(TFPAR_COLLECTIVE_TIMEOUT) for its peers at train step 4 of "
          f"strategy #1 (DataParallelStrategy): worker 1 "
          f"({run['addresses'][1]}) did not join") in error["message"]
  seconds = _seconds(run, (1, "stall"), 0)
  print(f"worker asleep: error after {seconds:.1f} s")
  assert COLLECTIVE <= seconds <= COLLECTIVE + GRACE + SLACK


def test_a_stopped_worker_is_named(runs):
  run = runs["stop"]
  error = _error(run, 0)
  assert error["type"] == "UnavailableError"
  assert (f"worker 1 ({run['addresses'][1]}) stopped sending heartbeats for "
          f"10 s (TFPAR_HEARTBEAT_TIMEOUT)") in error["message"]
  seconds = _seconds(run, (1, "stall"), 0)
  print(f"worker stopped (SIGSTOP): error after {seconds:.1f} s")
  assert seconds <= HEARTBEAT + SLACK


def test_a_worker_missing_from_a_checkpoint_gather_is_named(runs):
  """tfpar.save_weights under multi-worker ZeRO gathers the slices from
  every worker: one that never comes is named after the collective
  timeout, as in a step."""
  run = runs["save-skipped"]
  error = _error(run, 0)
  assert error["type"] == "DeadlineExceededError"
  assert (f"worker 0 ({run['addresses'][0]}) waited 15 s "
          f"(TFPAR_COLLECTIVE_TIMEOUT) for its peers at the gather of ZeRO "
          f"slices to save them of strategy #1 (DataParallelStrategy): "
          f"worker 1 ({run['addresses'][1]}) did not join") in error["message"]
  seconds = _seconds(run, (1, "stall"), 0)
  print(f"worker missing from a checkpoint gather: error after "
        f"{seconds:.1f} s")
  assert COLLECTIVE <= seconds <= COLLECTIVE + GRACE + SLACK


def test_a_dead_chief_is_named(runs):
  run = runs["chief-dies"]
  error = _error(run, 1)
  assert f"worker 0 ({run['addresses'][0]})" in error["message"]
  assert ("is gone" in error["message"] or
          "stopped answering heartbeats" in error["message"])
  seconds = _seconds(run, (0, "stall"), 1)
  print(f"chief died: error after {seconds:.1f} s")
  assert seconds <= HEARTBEAT + SLACK


def test_an_extra_strategy_on_the_chief_fails_on_every_worker(runs):
  """Each worker names both workers and the strategy each waits in (its
  own watchdog's report, or the chief's, which TF passes on when the
  chief aborts the collective both wait in)."""
  run = runs["extra-strategy"]
  first = min(run["events"][task]["strategy"]["time"] for task in (0, 1))
  for task in (0, 1):
    message = _error(run, task)["message"]
    assert message.startswith("worker "), message
    for worker, strategy in ((0, "strategy #2"), (1, "strategy #1")):
      address = re.escape(run["addresses"][worker])
      assert re.search(
          rf"worker {worker} \({address}\) (waited \d+ s "
          rf"\(TFPAR_COLLECTIVE_TIMEOUT\) for its peers at|waits in) the "
          rf"creation of variable 'kernel' of {strategy} ", message), message
    assert "the workers run different collectives" in message
    seconds = _error(run, task)["time"] - first
    print(f"extra strategy: worker {task} error after {seconds:.1f} s")
    assert COLLECTIVE <= seconds <= COLLECTIVE + GRACE + SLACK


def test_bad_timeouts_are_refused():
  with pytest.raises(ValueError, match=r"TFPAR_COLLECTIVE_TIMEOUT must be a "
                     r"positive number of seconds.*Received: "
                     r"TFPAR_COLLECTIVE_TIMEOUT='-3'"):
    timeouts.Timeouts.from_environment({"TFPAR_COLLECTIVE_TIMEOUT": "-3"})
  assert timeouts.Timeouts.from_environment(
      {"TFPAR_CONNECT_TIMEOUT": "none"}).connect is None


@pytest.mark.parametrize("message, named", [
    ("Collective ops is aborted by: Error reported from /job:worker/task:1: "
     "The following tasks are unhealthy (stopped sending heartbeats):\n"
     "/job:worker/replica:0/task:1\nThe tasks have crashed.",
     "worker 1 (127.0.0.1:2) stopped sending heartbeats for 10 s"),
    ("Collective ops is aborted by: Deadline Exceeded\n\nRPC: "
     "/tensorflow.CoordinationService/Heartbeat\nThe error could be from a "
     "previous operation.",
     "worker 0 (127.0.0.1:1), which runs the cluster's coordination service, "
     "stopped answering heartbeats"),
    ("Collective ops is aborted by: recvmsg:Connection reset by peer\n"
     "Additional GRPC error information from remote target "
     "/job:worker/replica:0/task:0 while calling "
     "/tensorflow.WorkerService/CompleteInstance:",
     "worker 0 (127.0.0.1:1) is gone"),
])
def test_tensorflow_peer_errors_are_named(message, named):
  """The messages TF 2.21 gave in the scenarios above."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfpar import cluster  # pylint: disable=g-import-not-at-top
  layout = cluster.ClusterLayout(
      {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 1,
      (("worker", 0), ("worker", 1)), "CPU", 2)
  clear = peer_report.explain(tf.errors.UnavailableError(None, None, message),
                              layout, timeouts.Timeouts(heartbeat=10))
  assert isinstance(clear, tf.errors.UnavailableError)
  assert clear.message.startswith(named), clear.message
  assert peer_report.explain(tf.errors.UnavailableError(None, None, "other"),
                             layout, timeouts.Timeouts()) is None
