"""tfpar's command-line tools leave TensorFlow's start-up log out.

The lines are TensorFlow's own, printed by a real start-up in a subprocess
(`TF_CPP_MIN_LOG_LEVEL` does not silence them in TensorFlow 2.21).
"""

import functools
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from tfpar import tf_startup_log

_HERE = os.path.dirname(os.path.abspath(__file__))
_PLAN = ["plan", "--devices", "4", "--memory-per-device", "16GB"]


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if k not in ("TF_CPP_MIN_LOG_LEVEL", tf_startup_log.SHOW_ENV)}
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(_HERE), _HERE, env.get("PYTHONPATH", "")])
  env.update(extra)
  return env


def _tfpar(*args, **env):
  return subprocess.run([sys.executable, "-m", "tfpar", *args],
                        capture_output=True, text=True, timeout=300,
                        env=_env(**env), cwd=_HERE)


@functools.lru_cache(maxsize=None)
def _tensorflow_start_up():
  """What a process that starts TensorFlow and runs an op writes to its
  standard error, line by line."""
  run = subprocess.run(
      [sys.executable, "-c",
       "import tensorflow as tf; print(float(tf.constant(2.0) + 1))"],
      capture_output=True, text=True, timeout=300, env=_env())
  assert run.returncode == 0 and run.stdout == "3.0\n", run.stderr
  return tuple(run.stderr.splitlines())


def test_a_tensorflow_start_up_prints_noise_the_filter_knows():
  lines = _tensorflow_start_up()
  noise = [line for line in lines if tf_startup_log.is_startup_noise(line)]
  # oneDNN's notice, no CUDA driver, absl's banner at the least.
  assert len(noise) >= 3, lines
  assert any("oneDNN" in line for line in noise), lines


def test_plan_with_a_parameter_count_starts_no_tensorflow(tmp_path):
  png = tmp_path / "plan.png"
  run = subprocess.run(
      [sys.executable, "-c",
       "import sys; from tfpar import cli; code = cli.main(sys.argv[1:]); "
       "print('tensorflow' in sys.modules, 'keras' in sys.modules); "
       "sys.exit(code)",
       "plan", "--parameters", "7.5e9", "--devices", "64",
       "--memory-per-device", "32GB", "--plot", str(png)],
      capture_output=True, text=True, timeout=120, env=_env())
  assert run.returncode == 0, run.stderr
  assert run.stderr == ""
  assert run.stdout.splitlines()[-1] == "False False"
  import tfpar.planner  # pylint: disable=g-import-not-at-top
  from tfpar.planner import chart  # pylint: disable=g-import-not-at-top
  result = tfpar.planner.plan(7.5e9, 64, "32GB")
  drawn = tf.io.decode_png(tf.io.read_file(str(png))).numpy()
  np.testing.assert_array_equal(drawn, chart.chart_image(result,
                                                         result.shown()))


def test_plan_with_a_model_leaves_the_start_up_log_out():
  quiet = _tfpar(*_PLAN, "--model", "tp_common:mlp")
  assert quiet.returncode == 0, quiet.stderr
  assert "'mlp' on 4 devices" in quiet.stdout
  assert quiet.stderr == ""
  everything = _tfpar(*_PLAN, "--model", "tp_common:mlp",
                      **{tf_startup_log.SHOW_ENV: "1"})
  assert everything.returncode == 0, everything.stderr
  assert any(tf_startup_log.is_startup_noise(line)
             for line in everything.stderr.splitlines())
  assert everything.stdout == quiet.stdout


def test_plan_errors_still_reach_the_user():
  run = _tfpar(*_PLAN, "--model", "tp_common:no_such_function")
  assert run.returncode == 2
  assert run.stderr == ("tfpar plan: error: --model "
                        "'tp_common:no_such_function': module 'tp_common' "
                        "has no function 'no_such_function'.\n")


def _echo_worker(tmp_path, lines):
  """A worker script that writes `lines` (TensorFlow's start-up, and a
  warning that is not noise) to its standard error, then 'done'."""
  log = tmp_path / "start_up.txt"
  log.write_text("\n".join(lines) + "\n")
  script = tmp_path / "worker.py"
  script.write_text(
      "import sys\n"
      f"sys.stderr.write(open({str(log)!r}).read())\n"
      "sys.stderr.flush()\n"
      "print('done')\n")
  return str(script)


def test_launch_leaves_out_the_workers_start_up_log(tmp_path):
  start_up = _tensorflow_start_up()
  kept_warning = ("W0000 00:00:1796031356.2 3 ring_reducer.cc:90] a "
                  "collective warning the user must see")
  # TensorFlow's Python logger at INFO (the README demo's workers print it).
  start_up += ("INFO:tensorflow:Check health not enabled.",)
  script = _echo_worker(tmp_path, start_up + (kept_warning,))
  noise = sum(tf_startup_log.is_startup_noise(line) for line in start_up)
  assert noise == len(start_up)

  run = _tfpar("launch", "--workers", "2", "--no-isolate-network", script)
  assert run.returncode == 0, run.stdout + run.stderr
  lines = run.stdout.splitlines()
  for index in range(2):
    assert f"[worker {index}] done" in lines
    assert f"[worker {index}] {kept_warning}" in lines
  assert not [line for line in lines
              if tf_startup_log.is_startup_noise(line.partition("] ")[2])]
  assert lines[-1] == (f"tfpar launch: left out {2 * noise} lines of "
                       f"TensorFlow's start-up log (TFPAR_TF_LOGS=1 shows "
                       f"them)")

  everything = _tfpar("launch", "--workers", "2", "--no-isolate-network",
                      script, **{tf_startup_log.SHOW_ENV: "1"})
  assert everything.returncode == 0
  shown = everything.stdout.splitlines()
  for line in start_up:
    assert f"[worker 0] {line}" in shown and f"[worker 1] {line}" in shown
  assert not any(line.startswith("tfpar launch: left out") for line in shown)


def test_filtered_stderr_holds_and_replays_what_is_not_noise(capfd):
  with tf_startup_log.filtered_stderr():
    os.write(2, b"I0000 00:00:1796031355.9 2 port.cc:153] oneDNN custom "
                b"operations are on.\n")
    sys.stderr.write("a warning of the user's own\n")
    print("on stdout, at once")
    os.write(2, b"E0000 00:00:1796031355.9 2 cuda_platform.cc:52] failed "
                b"call to cuInit: INTERNAL: CUDA error\n")
  out, err = capfd.readouterr()
  assert out == "on stdout, at once\n"
  assert err == "a warning of the user's own\n"
