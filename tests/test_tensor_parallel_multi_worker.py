"""TensorParallelStrategy across 2 TF_CONFIG workers x 2 virtual CPUs:
tensor 2 inside each worker, data 2 across them, equal to one device:
every device tracing the step, here under `tfpar.ZeRO(stage=2)`: each
tensor column's optimizer state sliced across the workers, gathered to
save it whole. `TFPAR_TEST_FULL=1` adds ZeRO stage 3, whose weights are
sliced across the workers too."""

import json
import os

import numpy as np
import pytest

import launch_common
import suite_scope
import tfpar
import tp_common

WORKER = os.path.join(os.path.dirname(__file__), "workers", "tp_worker.py")
LAUNCH_TIMEOUT = 300


@pytest.mark.parametrize("zero", suite_scope.cases(["zero2"], ["zero3"]))
def test_two_workers_tensor_parallel_fit_equals_one_device(tmp_path, zero):
  launch_common.launch_ok(WORKER, tmp_path, zero,
                          timeout=LAUNCH_TIMEOUT)
  results = [json.load(open(tmp_path / f"worker{i}.json")) for i in range(2)]
  assert [r["num_replicas"] for r in results] == [2, 2]
  assert results[1]["groups"] == [[
      "/job:worker/replica:0/task:1/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:1"]]

  one_device = tp_common.trained_gpt()  # Shared with the other GPT tests.
  reference, losses = one_device.model, one_device.losses
  px, py = tp_common.data("gpt", count=20, seed=7)
  weights = tfpar.logical_weights(reference)
  evaluation = reference.evaluate(px, py, batch_size=8, verbose=0)
  predictions = reference.predict(px, batch_size=8, verbose=0)
  for result in results:
    np.testing.assert_allclose(result["losses"], losses, atol=1e-5, rtol=0)
    np.testing.assert_allclose(result["evaluate"], evaluation, atol=1e-5)
    np.testing.assert_allclose(result["predict"], predictions, atol=1e-5)
    for path, value in weights.items():
      np.testing.assert_allclose(result["weights"][path], value, atol=1e-5,
                                 err_msg=path)
  assert results[0]["weights"] == results[1]["weights"]
  # Keras's weight API in whole weights across workers: get_weights and
  # the numpy values of model.weights give one device's arrays (count,
  # order, shapes, values), count_params its count; set_weights takes
  # them (predictions of a fresh seed-9 GPT's weights). The same one-device
  # GPT then loads the workers' save (one predict function for both).
  restored = tp_common.compile_model(tp_common.gpt(seed=9))
  fresh_predictions = restored.predict(px, verbose=0)
  for result in results:
    for got in (result["get_weights"], result["weights_numpy"]):
      assert [np.shape(w) for w in got] == [
          w.shape for w in reference.get_weights()]
      for ours, theirs in zip(got, reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert result["count_params"] == reference.count_params()
    np.testing.assert_allclose(result["predict_after_set_weights"],
                               fresh_predictions, atol=1e-5)

  restored.optimizer.build(restored.trainable_variables)
  restored.load_weights(str(tmp_path / "weights.weights.h5"))
  np.testing.assert_allclose(restored.predict(px, verbose=0),
                             reference.predict(px, verbose=0), atol=1e-5)
  # The whole optimizer state (under ZeRO: every worker's slices of every
  # tensor column, gathered) is one device's.
  tp_common.assert_same_optimizer_state(restored, reference)
