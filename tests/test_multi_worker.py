"""DataParallelStrategy across 2 TF_CONFIG workers x 2 virtual CPUs.

The workers are real processes started by `tfpar launch` on loopback ports;
their results are compared with one-device training in this process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dp_common
import stock_strategies

TOLERANCE = 1e-5
WORKER = os.path.join(os.path.dirname(__file__), "workers", "dp_worker.py")
LAUNCH_TIMEOUT = 240


def _launch(*args, workers=2):
  command = [sys.executable, "-m", "tfpar", "launch", "--workers", str(workers),
             "--devices-per-worker", "2", "--timeout", str(LAUNCH_TIMEOUT),
             WORKER, *args]
  return subprocess.run(command, capture_output=True, text=True,
                        timeout=LAUNCH_TIMEOUT + 60)


def _results(out_dir, workers=2):
  return [json.load(open(os.path.join(out_dir, f"worker{i}.json")))
          for i in range(workers)]


@pytest.fixture(scope="module")
def reference():
  x, y = dp_common.make_data()
  model = dp_common.build_model()
  history = dp_common.fit(model, x, y, validation_data=(x[:64], y[:64]))
  return {
      "history": history,
      "evaluate": model.evaluate(x, y, batch_size=32, verbose=0),
      "predict": model.predict(x[:100], batch_size=32, verbose=0),
      "weights": model.get_weights(),
      "optimizer": [v.numpy() for v in model.optimizer.variables],
  }


def _assert_matches_reference(result, reference, epochs=slice(None)):
  for key in ("loss", "mae", "val_loss", "val_mae"):
    np.testing.assert_allclose(result["history"][key],
                               reference["history"][key][epochs],
                               atol=TOLERANCE, err_msg=key)
  np.testing.assert_allclose(result["evaluate"], reference["evaluate"],
                             atol=TOLERANCE)
  np.testing.assert_allclose(result["predict"], reference["predict"],
                             atol=TOLERANCE)
  for got, want in zip(result["weights"], reference["weights"]):
    np.testing.assert_allclose(got, want, atol=TOLERANCE)


def test_two_workers_fit_equals_one_device(tmp_path, reference):
  run = _launch(str(tmp_path))
  assert run.returncode == 0, run.stdout[-4000:]
  assert "[worker 0]" in run.stdout and "[worker 1]" in run.stdout
  results = _results(tmp_path)
  assert [r["num_replicas"] for r in results] == [4, 4]
  assert results[1]["local_devices"] == [
      "/job:worker/replica:0/task:1/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:1"]
  for result in results:
    _assert_matches_reference(result, reference)
  # Identical weights on both workers, to the bit.
  assert results[0]["weights"] == results[1]["weights"]
  assert results[0]["history"] == results[1]["history"]

  # Weights saved by the chief load into a model with no strategy.
  _assert_checkpoint_holds(str(tmp_path / "weights.weights.h5"), reference)


def test_killed_worker_resumes_from_backup(tmp_path, reference):
  backup = str(tmp_path / "backup")
  crashed = _launch(str(tmp_path), "--backup", backup, "--die-in-epoch", "2")
  assert crashed.returncode == 17, crashed.stdout[-4000:]
  assert "worker 1 exited with code 17" in crashed.stdout
  assert sorted(os.listdir(backup + "_ckpt")) == ["e1.weights.h5",
                                                  "e2.weights.h5"]
  assert not os.path.exists(tmp_path / "worker0.json")

  resumed = _launch(str(tmp_path), "--backup", backup)
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  for result in _results(tmp_path):
    assert len(result["history"]["loss"]) == 1  # Resumed at the third epoch.
    _assert_matches_reference(result, reference, epochs=slice(2, 3))
  assert not os.path.exists(backup)  # The chief cleaned up after success.


def _assert_checkpoint_holds(path, reference):
  """A checkpoint of the workers loads into one device with no strategy,
  weights and optimizer state equal to one-device training."""
  model = dp_common.build_model(seed=5)
  model.optimizer.build(model.trainable_variables)
  model.load_weights(path)
  for got, want in zip(model.get_weights(), reference["weights"]):
    np.testing.assert_allclose(got, want, atol=TOLERANCE)
  assert len(model.optimizer.variables) == len(reference["optimizer"])
  for got, want in zip(model.optimizer.variables, reference["optimizer"]):
    np.testing.assert_allclose(got.numpy(), want, atol=TOLERANCE,
                               err_msg=got.path)


def test_killed_zero3_worker_resumes_and_saves_whole_state(tmp_path,
                                                          reference):
  """ZeRO-3 over 2 workers: each holds half of the weights and of Adam's
  state, yet backups, checkpoints and the final save hold whole tensors,
  and a killed job resumes from them."""
  backup = str(tmp_path / "backup")
  crashed = _launch(str(tmp_path), "--zero-stage", "3", "--backup", backup,
                    "--die-in-epoch", "2")
  assert crashed.returncode == 17, crashed.stdout[-4000:]
  assert sorted(os.listdir(backup + "_ckpt")) == ["e1.weights.h5",
                                                  "e2.weights.h5"]
  resumed = _launch(str(tmp_path), "--zero-stage", "3", "--backup", backup)
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  for result in _results(tmp_path):
    assert len(result["history"]["loss"]) == 1  # Resumed at the third epoch.
    _assert_matches_reference(result, reference, epochs=slice(2, 3))
    # Adam's moments of the 8 x 32 kernel: 256 / 4 replicas per device.
    assert [64] in result["optimizer_shapes"]
  _assert_checkpoint_holds(str(tmp_path / "weights.weights.h5"), reference)


def test_sigterm_saves_and_resumes_at_the_exact_step(tmp_path, reference):
  """SIGTERM to worker 1 before batch 3 of epoch 1: every worker backs up
  the same step and exits 143; the relaunch resumes at the next batch and
  ends with the weights of an uninterrupted run."""
  backup = str(tmp_path / "backup")
  preempted = _launch(str(tmp_path), "--backup", backup,
                      "--preempt-in-epoch", "1")
  assert preempted.returncode == 143, preempted.stdout[-4000:]
  assert "[worker 0] tfpar: preempted (SIGTERM); saved" in preempted.stdout
  assert "[worker 1] tfpar: preempted (SIGTERM); saved" in preempted.stdout
  with open(os.path.join(backup, "training_metadata.json")) as f:
    metadata = json.load(f)
  # Announced after batch 3 (the step it was in), saved after batch 4.
  assert (metadata["epoch"], metadata["tfpar_batches_done"]) == (1, 5)
  resumed = _launch(str(tmp_path), "--backup", backup)
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  for result in _results(tmp_path):
    # The rest of epoch 1 (its loss averages its last 3 batches), epoch 2.
    assert len(result["history"]["loss"]) == 2
    np.testing.assert_allclose(result["history"]["loss"][1],
                               reference["history"]["loss"][2],
                               atol=TOLERANCE)
    for got, want in zip(result["weights"], reference["weights"]):
      np.testing.assert_allclose(got, want, atol=TOLERANCE)
  _assert_checkpoint_holds(str(tmp_path / "weights.weights.h5"), reference)


def test_single_task_tf_config_job(tmp_path, reference):
  run = _launch(str(tmp_path), workers=1)
  assert run.returncode == 0, run.stdout[-4000:]
  (result,) = _results(tmp_path, workers=1)
  assert result["num_replicas"] == 2
  assert result["local_devices"][0] == "/job:worker/replica:0/task:0/device:CPU:0"
  _assert_matches_reference(result, reference)


def test_two_workers_with_zero_stage2_equal_one_device(tmp_path, reference):
  run = _launch(str(tmp_path), "--zero-stage", "2")
  assert run.returncode == 0, run.stdout[-4000:]
  results = _results(tmp_path)
  for result in results:
    _assert_matches_reference(result, reference)
    # Adam's moments of the 8 x 32 kernel: 256 / 4 replicas per device.
    assert [64] in result["optimizer_shapes"]
    assert [8, 32] not in result["optimizer_shapes"]
  assert results[0]["weights"] == results[1]["weights"]
  _assert_checkpoint_holds(str(tmp_path / "weights.weights.h5"), reference)


def test_two_workers_accumulating_gradients_equal_one_device(tmp_path):
  x, y = dp_common.make_data()
  model = dp_common.build_model(gradient_accumulation_steps=2)
  history = dp_common.fit(model, x, y, validation_data=(x[:64], y[:64]))
  reference = {
      "history": history,
      "evaluate": model.evaluate(x, y, batch_size=32, verbose=0),
      "predict": model.predict(x[:100], batch_size=32, verbose=0),
      "weights": model.get_weights(),
  }
  run = _launch(str(tmp_path), "--accumulate", "2")
  assert run.returncode == 0, run.stdout[-4000:]
  results = _results(tmp_path)
  for result in results:
    _assert_matches_reference(result, reference)
  assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_two_workers_under_a_mixed_policy_train_like_mirrored(tmp_path,
                                                              policy):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x, y = dp_common.make_data()
  keras.mixed_precision.set_global_policy(policy)
  try:
    reference = dp_common.build_model()
    history = dp_common.fit(reference, x, y)
    with stock_strategies.mirrored(
        [d.name for d in tf.config.list_logical_devices("CPU")]).scope():
      mirrored = dp_common.build_model()
    mirrored_history = dp_common.fit(mirrored, x, y)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  run = _launch(str(tmp_path), "--policy", policy)
  assert run.returncode == 0, run.stdout[-4000:]
  spread_loss = np.abs(np.subtract(mirrored_history["loss"],
                                   history["loss"])).max()
  spread_weights = max(np.abs(a - b).max() for a, b in zip(
      mirrored.get_weights(), reference.get_weights()))
  for result in _results(tmp_path):
    loss = np.abs(np.subtract(result["history"]["loss"],
                              history["loss"])).max()
    weights = max(np.abs(np.array(a) - b).max() for a, b in zip(
        result["weights"], reference.get_weights()))
    print(f"{policy} workers: loss {loss:.1e} weights {weights:.1e}; "
          f"mirrored {spread_loss:.1e} / {spread_weights:.1e}")
    assert loss <= 2 * spread_loss + 1e-5
    assert weights <= 2 * spread_weights + 1e-5
