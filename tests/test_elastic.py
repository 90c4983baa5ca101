"""Elastic jobs: a backup resumes on another number of workers, and
`tfpar launch --elastic` restarts a job on the workers left when one dies.

One launched chain (real processes on loopback) covers data parallelism and
ZeRO-3: a 1-worker job (2 replicas) is interrupted in epoch 0; the elastic
job resumes it on 3 workers (6 replicas: more), worker 1 kills itself
(SIGKILL) in the data-parallel run's epoch 1 and the launcher restarts on 2
workers (4 replicas: fewer), where the ZeRO-3 run resumes from the
1-worker backup (more), loses worker 1 again and finishes on 1 worker
(fewer). The global batch (24) is kept by adjusting the per-replica batch
(12, 4, 6, 12); both final models equal one device's training to 1e-5.
"""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dp_common
import launch_common
import tfpar
from tfpar import launch_elastic
from tfpar import supervise
from tfpar import launch as launch_lib

_WORKER = os.path.join(os.path.dirname(__file__), "workers",
                       "elastic_worker.py")
sys.path.insert(0, os.path.dirname(_WORKER))
import elastic_worker  # pylint: disable=g-import-not-at-top,wrong-import-position


def _reference():
  x, y = elastic_worker.data()
  model = dp_common.build_model()
  model.fit(x, y, batch_size=elastic_worker.GLOBAL_BATCH,
            epochs=elastic_worker.EPOCHS, shuffle=False, verbose=0)
  return model.get_weights()


def _times(path):
  with open(path) as f:
    return [float(line) for line in f.read().split()]


def test_elastic_job_resumes_on_fewer_and_more_workers(tmp_path):
  out = str(tmp_path)
  launch_common.launch_ok(_WORKER, out, "dp,interrupt=0.5",
                          "zero3,interrupt=0.5", workers=1)
  run = subprocess.run(
      [sys.executable, "-m", "tfpar", "launch", "--elastic", "--min-workers",
       "1", "--max-restarts", "2", "--workers", "3", "--devices-per-worker",
       "2", "--timeout", "400", _WORKER, out, "dp,kill=0.1.5",
       "zero3,kill=1.1.5"], capture_output=True, text=True, timeout=460)
  log = run.stdout
  assert run.returncode == 0, log[-6000:] + run.stderr[-2000:]
  for line in (
      "from a backup made on 2 replicas on 1 worker(s)",  # 1 -> 3 workers.
      "tfpar: resuming at batch 4 of the epoch, on 6 replicas on 3 worker(s)",
      "tfpar launch: lost worker 1 (killed by signal 9); the others stopped",
      "restarting on 2 workers from the last backup (restart 1 of 2",
      "restarting on 1 workers from the last backup (restart 2 of 2",
      "from a backup made on 6 replicas on 3 worker(s)",  # 3 -> 2.
      "from a backup made on 4 replicas on 2 worker(s)",  # 2 -> 1.
      "global batch 24 kept on 4 replicas: per-replica batch 6 (adjusted)"):
    assert line in log, (line, log[-6000:])
  want = _reference()
  for layout, (replicas, workers) in (("dp", (4, 2)), ("zero3", (2, 1))):
    with open(os.path.join(out, f"{layout}.json")) as f:
      result = json.load(f)
    assert (result["replicas"], result["workers"]) == (replicas, workers)
    assert result["iterations"] == 24  # 3 epochs of 8 updates, not more.
    for got, expected in zip(result["weights"], want):
      np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
  for restart in (1, 2):
    killed = _times(os.path.join(out, f"killed.{restart - 1}"))[0]
    training = min(t for t in _times(os.path.join(out, f"training.{restart}"))
                   if t > killed)
    print(f"\nrestart {restart}: training again {training - killed:.1f} s "
          "after the kill")
    assert training - killed < 120


def _script(tmp_path, body):
  path = tmp_path / "script.py"
  path.write_text("import json, os, sys, time\n"
                  "index = json.loads(os.environ['TF_CONFIG'])['task']"
                  "['index']\n"
                  "workers = len(json.loads(os.environ['TF_CONFIG'])"
                  "['cluster']['worker'])\n"
                  "restart = int(os.environ['TFPAR_ELASTIC_RESTART'])\n"
                  + body)
  return str(path)


def _elastic(script, *flags, workers=3):
  config = launch_lib.LaunchConfig(
      (sys.executable, script), workers=workers, isolate_network=False,
      elastic=True, timeout=60, **dict(flags))
  out = io.StringIO()
  return launch_lib.launch(config, out), out.getvalue()


def test_the_launcher_gives_up_and_leaves_preempted_workers_out(tmp_path):
  # A worker dies on every run: the budget, then the minimum, end the job.
  dies = _script(tmp_path, "if index == 1: sys.exit(7)\ntime.sleep(60)\n")
  code, log = _elastic(dies, ("min_workers", 1), ("max_restarts", 1))
  assert code == 7
  assert "restarting on 2 workers" in log
  assert "giving up: the restart budget (--max-restarts 1) is spent" in log
  code, log = _elastic(dies, ("min_workers", 2), ("max_restarts", 5))
  assert code == 7 and "giving up: 1 worker(s) left, fewer than " \
      "--min-workers 2" in log, log
  # Preempted (every worker exits 143, worker 2 got the SIGTERM): the
  # restart leaves worker 2 out; the 2-worker run succeeds.
  preempted = _script(tmp_path, (
      "if restart == 0:\n"
      "  if index == 2:\n"
      "    open(os.path.join(os.environ['TFPAR_ELASTIC_STATE_DIR'],"
      " 'preempted.2'), 'w').close()\n"
      "  sys.exit(143)\n"
      "print('ran on', workers)\n"))
  code, log = _elastic(preempted, ("max_restarts", 1))
  assert code == 0, log
  assert "worker(s) [2] preempted (SIGTERM)" in log
  assert log.count("ran on 2") == 2


def test_elastic_settings_are_checked():
  with pytest.raises(ValueError, match=r"--min-workers must be at most "
                     r"--workers.*Received: --min-workers 4, --workers 3"):
    launch_lib.LaunchConfig(("x",), workers=3, elastic=True, min_workers=4)
  with pytest.raises(ValueError, match="--max-restarts only apply with "
                     "--elastic"):
    launch_lib.LaunchConfig(("x",), max_restarts=2)
  with pytest.raises(ValueError, match="--max-restarts must be a "
                     "non-negative integer. Received: -1"):
    launch_lib.LaunchConfig(("x",), elastic=True, max_restarts=-1)
  assert launch_elastic.STOP_GRACE_SECONDS < supervise.GRACE_SECONDS


def test_a_resume_that_cannot_keep_the_global_batch_is_refused(tmp_path):
  with pytest.raises(ValueError, match="The global batch 24 cannot be kept "
                     "on 5 replicas.*24 is not a multiple of 5"):
    tfpar.keep_global_batch(5, 24)
  with pytest.raises(ValueError, match="a step takes 20 examples, and 24 is "
                     "not a multiple of 20"):
    tfpar.keep_global_batch(4, 24, "gradient_accumulation_steps",
                            per_replica_batch=5)
  # A backup made with global batch 24 (8 updates per epoch) refuses a run
  # with batch 12 (16), before loading anything.
  x, y = elastic_worker.data()
  backup_dir = str(tmp_path / "backup")
  model = dp_common.build_model()
  with pytest.raises(RuntimeError, match="interrupted"):
    model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0,
              callbacks=[tfpar.BackupAndRestore(backup_dir, save_freq=2),
                         elastic_worker.Events(None, 0, interrupt=(0, 3))])
  resumed = dp_common.build_model(seed=3)
  before = resumed.get_weights()
  with pytest.raises(ValueError, match=r"backup made on 1 replicas on 1 "
                     r"worker\(s\), 8 steps per epoch \(8 optimizer updates "
                     r"per epoch\) on 1 replicas on 1 worker\(s\), 16 steps "
                     r"per epoch \(16 updates per epoch\): the global batch "
                     r"changed"):
    resumed.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0,
                callbacks=[tfpar.BackupAndRestore(backup_dir, save_freq=2)])
  for got, want in zip(resumed.get_weights(), before):
    np.testing.assert_array_equal(got, want)  # Nothing loaded or trained.


def test_get_weights_on_the_chief_alone_under_zero3_is_a_clear_error(
    tmp_path):
  launch_common.launch_ok(_WORKER, str(tmp_path), "one_sided_read",
                          workers=2, devices_per_worker=1)
  with open(tmp_path / "one_sided.json") as f:
    result = json.load(f)
  error = result["error"]
  assert error.startswith("UnavailableError: worker 1 ("), error
  assert "is gone" in error and "every worker makes the same call" in error
  print(f"\none-sided get_weights: the error after {result['seconds']:.1f} s")
  assert result["seconds"] < 60
