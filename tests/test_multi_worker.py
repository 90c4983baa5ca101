"""DataParallelStrategy across 2 TF_CONFIG workers x 2 virtual CPUs.

The workers are real processes started by `tfpar launch` on loopback ports;
their results are compared with one-device training in this process. Each
launch runs several scenarios in order (module fixtures shared by the
tests), so that the workers pay TensorFlow's start and the cluster's
connection once for all of them.
"""

import json
import os
import re

import numpy as np
import pytest

import dp_common
import launch_common
import stock_strategies

TOLERANCE = 1e-5
WORKER = os.path.join(os.path.dirname(__file__), "workers", "dp_worker.py")
LAUNCH_TIMEOUT = 600  # Seconds for one launch of up to 6 fits.


def _launch(out_dir, *scenarios, workers=2):
  """One `tfpar launch` whose workers run `scenarios` in order (see
  dp_worker.py)."""
  return launch_common.launch(WORKER, out_dir, *scenarios, workers=workers,
                              timeout=LAUNCH_TIMEOUT)


def _results(out_dir, scenario, run, workers=2):
  paths = [os.path.join(out_dir, f"{scenario}_worker{i}.json")
           for i in range(workers)]
  assert all(map(os.path.exists, paths)), run.stdout[-4000:]
  return [json.load(open(path)) for path in paths]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("dp_workers")


# A chain of launches: a crash or a preemption ends each one, and the next
# one resumes from its backup before its own interruption.
@pytest.fixture(scope="module")
def fits(out_dir):
  """Fits of every kind, each equal to one-device training; then worker 1
  dies in epoch 2 of a backed-up fit (so the launch exits 17)."""
  return _launch(out_dir, "plain", "zero2,zero_stage=2",
                 "accumulate,accumulate=2",
                 "mixed_float16,policy=mixed_float16",
                 "mixed_bfloat16,policy=mixed_bfloat16",
                 "crashed,backup=backup,die_in_epoch=2")


def _assert_fits_ran(fits):
  """The fits' launch ran every fit and ended in the planned crash."""
  assert fits.returncode == 17, fits.stdout[-4000:]
  assert "worker 1 exited with code 17" in fits.stdout, fits.stdout[-4000:]


@pytest.fixture(scope="module")
def crashed(fits):
  """The launch whose last fit crashed."""
  return fits


@pytest.fixture(scope="module")
def resumed(out_dir, crashed):
  """The crashed fit resumes; then worker 1 dies in a ZeRO-3 fit."""
  del crashed  # It made the backup.
  return _launch(out_dir, "resumed,backup=backup",
                 "zero3_crashed,zero_stage=3,backup=zero3_backup,"
                 "die_in_epoch=2")


@pytest.fixture(scope="module")
def zero3_resumed(out_dir, resumed):
  """The ZeRO-3 fit resumes; then SIGTERM to worker 1 in epoch 1."""
  del resumed  # It made the backup.
  return _launch(out_dir, "zero3_resumed,zero_stage=3,backup=zero3_backup",
                 "preempted,backup=preempt_backup,preempt_in_epoch=1")


@pytest.fixture(scope="module")
def preempt_resumed(out_dir, zero3_resumed):
  """The preempted fit resumes."""
  del zero3_resumed  # It made the backup.
  return _launch(out_dir, "preempt_resumed,backup=preempt_backup")


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


def test_two_workers_fit_equals_one_device(out_dir, fits, reference):
  _assert_fits_ran(fits)
  assert "[worker 0]" in fits.stdout and "[worker 1]" in fits.stdout
  results = _results(out_dir, "plain", fits)
  assert [r["num_replicas"] for r in results] == [4, 4]
  assert results[1]["local_devices"] == [
      "/job:worker/replica:0/task:1/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:1"]
  for result in results:
    _assert_matches_reference(result, reference)
  # Identical weights on both workers, to the bit.
  assert results[0]["weights"] == results[1]["weights"]
  assert results[0]["history"] == results[1]["history"]
  # steps_per_execution > 1 across workers: refused before any work.
  for result in results:
    assert result["looped_fit"]["distributed"] == 0
    assert re.search(r"cannot run fit with steps_per_execution > 1.*between "
                     r"workers.*Received: steps_per_execution=2",
                     result["looped_fit"]["error"]), result["looped_fit"]

  # Weights saved by the chief load into a model with no strategy.
  _assert_checkpoint_holds(str(out_dir / "plain.weights.h5"), reference)


def test_killed_worker_resumes_from_backup(out_dir, crashed, resumed,
                                           reference):
  assert crashed.returncode == 17, crashed.stdout[-4000:]
  assert "worker 1 exited with code 17" in crashed.stdout
  assert sorted(os.listdir(out_dir / "crashed_ckpt")) == ["e1.weights.h5",
                                                          "e2.weights.h5"]
  assert not os.path.exists(out_dir / "crashed_worker0.json")

  # 17: the ZeRO-3 fit that follows the resumed one in the launch crashed.
  assert resumed.returncode == 17, resumed.stdout[-4000:]
  for result in _results(out_dir, "resumed", resumed):
    assert len(result["history"]["loss"]) == 1  # Resumed at the third epoch.
    _assert_matches_reference(result, reference, epochs=slice(2, 3))
  assert not os.path.exists(out_dir / "backup")  # The chief cleaned up.


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


def test_killed_zero3_worker_resumes_and_saves_whole_state(
    out_dir, resumed, zero3_resumed, reference):
  """ZeRO-3 over 2 workers: each holds half of the weights and of Adam's
  state, yet backups, checkpoints and the final save hold whole tensors,
  and a killed job resumes from them."""
  assert resumed.returncode == 17, resumed.stdout[-4000:]
  assert sorted(os.listdir(out_dir / "zero3_crashed_ckpt")) == [
      "e1.weights.h5", "e2.weights.h5"]
  # 143: the fit that follows the resumed one in the launch was preempted.
  assert zero3_resumed.returncode == 143, zero3_resumed.stdout[-4000:]
  for result in _results(out_dir, "zero3_resumed", zero3_resumed):
    assert len(result["history"]["loss"]) == 1  # Resumed at the third epoch.
    _assert_matches_reference(result, reference, epochs=slice(2, 3))
    # Adam's moments of the 8 x 32 kernel: 256 / 4 replicas per device.
    assert [64] in result["optimizer_shapes"]
  _assert_checkpoint_holds(str(out_dir / "zero3_resumed.weights.h5"),
                           reference)


def test_sigterm_saves_and_resumes_at_the_exact_step(
    out_dir, zero3_resumed, preempt_resumed, reference):
  """SIGTERM to worker 1 before batch 3 of epoch 1: every worker backs up
  the same step and exits 143; the relaunch resumes at the next batch and
  ends with the weights of an uninterrupted run."""
  preempted = zero3_resumed
  assert preempted.returncode == 143, preempted.stdout[-4000:]
  assert "[worker 0] tfpar: preempted (SIGTERM); saved" in preempted.stdout
  assert "[worker 1] tfpar: preempted (SIGTERM); saved" in preempted.stdout
  assert preempt_resumed.returncode == 0, preempt_resumed.stdout[-4000:]
  for result in _results(out_dir, "preempt_resumed", preempt_resumed):
    metadata = result["resumed_from"]
    # Announced after batch 3 (the step it was in), saved after batch 4.
    assert (metadata["epoch"], metadata["tfpar_batches_done"]) == (1, 5)
    # The rest of epoch 1 (its loss averages its last 3 batches), epoch 2.
    assert len(result["history"]["loss"]) == 2
    np.testing.assert_allclose(result["history"]["loss"][1],
                               reference["history"]["loss"][2],
                               atol=TOLERANCE)
    for got, want in zip(result["weights"], reference["weights"]):
      np.testing.assert_allclose(got, want, atol=TOLERANCE)
  _assert_checkpoint_holds(str(out_dir / "preempt_resumed.weights.h5"),
                           reference)


def test_single_task_tf_config_job(tmp_path, reference):
  """Then a strategy for another cluster in the same process is refused
  (TF serves one cluster per process) before it starts anything."""
  run = _launch(tmp_path, "plain", "other_cluster", workers=1)
  assert run.returncode == 0, run.stdout[-4000:]
  (result,) = _results(tmp_path, "plain", run, workers=1)
  assert result["num_replicas"] == 2
  assert result["local_devices"][0] == (
      "/job:worker/replica:0/task:0/device:CPU:0")
  _assert_matches_reference(result, reference)
  with open(tmp_path / "other_cluster.json") as f:
    other = json.load(f)
  assert other["error"] is not None
  assert "already runs TensorFlow's collective server as task 'worker:0'" in (
      other["error"])
  assert other["tf_config"]["cluster"]["worker"][0] in other["error"]


def test_two_workers_with_zero_stage2_equal_one_device(out_dir, fits,
                                                       reference):
  _assert_fits_ran(fits)
  results = _results(out_dir, "zero2", fits)
  for result in results:
    _assert_matches_reference(result, reference)
    # Adam's moments of the 8 x 32 kernel: 256 / 4 replicas per device.
    assert [64] in result["optimizer_shapes"]
    assert [8, 32] not in result["optimizer_shapes"]
  assert results[0]["weights"] == results[1]["weights"]
  _assert_checkpoint_holds(str(out_dir / "zero2.weights.h5"), reference)


def test_two_workers_accumulating_gradients_equal_one_device(out_dir, fits):
  x, y = dp_common.make_data()
  model = dp_common.build_model(gradient_accumulation_steps=2)
  history = dp_common.fit(model, x, y, validation_data=(x[:64], y[:64]))
  reference = {
      "history": history,
      "evaluate": model.evaluate(x, y, batch_size=32, verbose=0),
      "predict": model.predict(x[:100], batch_size=32, verbose=0),
      "weights": model.get_weights(),
  }
  _assert_fits_ran(fits)
  results = _results(out_dir, "accumulate", fits)
  for result in results:
    _assert_matches_reference(result, reference)
  assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_two_workers_under_a_mixed_policy_train_like_mirrored(out_dir, fits,
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
    # The same batches in the same order from one input iterator (a
    # 4-replica fit makes a new one each epoch otherwise).
    mirrored_history = dp_common.fit_one_iterator(mirrored, x, y)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  _assert_fits_ran(fits)
  spread_loss = np.abs(np.subtract(mirrored_history["loss"],
                                   history["loss"])).max()
  spread_weights = max(np.abs(a - b).max() for a, b in zip(
      mirrored.get_weights(), reference.get_weights()))
  for result in _results(out_dir, policy, fits):
    loss = np.abs(np.subtract(result["history"]["loss"],
                              history["loss"])).max()
    weights = max(np.abs(np.array(a) - b).max() for a, b in zip(
        result["weights"], reference.get_weights()))
    print(f"{policy} workers: loss {loss:.1e} weights {weights:.1e}; "
          f"mirrored {spread_loss:.1e} / {spread_weights:.1e}")
    assert loss <= 2 * spread_loss + 1e-5
    assert weights <= 2 * spread_weights + 1e-5
