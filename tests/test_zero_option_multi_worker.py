"""`DataParallelStrategy(mesh, zero=tfpar.ZeRO(stage=3))` across 2 TF_CONFIG
workers x 2 virtual CPUs: weights created where they live.

Each worker draws every initial value with the same seed and keeps only its
replicas' slices, so nothing is communicated to initialize and no device
ever holds more than its final share plus one whole weight in transit. The
workers (zero_option_worker.py) count every TensorFlow variable they create
per device, independently of tfpar, from the first variable to the end of
training, and train the same seeded MLP on one device of their own for the
reference. A first build with another seed on worker 1 must be refused.
"""

import json
import os

import numpy as np
import pytest

import launch_common

WORKER = os.path.join(os.path.dirname(__file__), "workers",
                      "zero_option_worker.py")
TIMEOUT = 120  # Seconds; the launch takes about 20 on the test machine.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("zero_option")
  launch_common.launch_ok(WORKER, out_dir, timeout=TIMEOUT)
  results = []
  for task in range(2):
    with open(out_dir / f"worker{task}.json") as f:
      measured = json.load(f)
    with np.load(out_dir / f"worker{task}.npz") as arrays:
      measured["arrays"] = dict(arrays)
    results.append(measured)
  return results


def _weights(arrays, name):
  count = sum(1 for key in arrays if key.startswith("reference_initial_"))
  return [arrays[f"{name}_{index}"] for index in range(count)]


def test_no_device_holds_more_than_its_share_and_one_weight(workers):
  for task, measured in enumerate(workers):
    reference = _weights(measured["arrays"], "reference_initial")
    whole = sum(w.nbytes for w in reference)
    largest = measured["largest"]
    assert largest == max(w.nbytes for w in reference)
    assert sorted(measured["peak"]) == ["CPU:0", "CPU:1"], measured
    for device, peak in measured["peak"].items():
      final = measured["final"][device]
      print(f"worker {task} {device}: peak {peak}, final {final}, "
            f"largest weight {largest}, whole model {whole}")
      assert peak <= final + largest, (task, device, peak, final)
      # A whole copy of the model would break the bound: the test can fail.
      assert final + largest < whole, (final, largest, whole)
      # The final share is a quarter of the weights (and a little more).
      assert whole / 4 <= final < whole / 4 + largest, (final, whole)


def test_initial_values_are_one_devices_draws(workers):
  for measured in workers:
    arrays = measured["arrays"]
    reference = _weights(arrays, "reference_initial")
    for name in ("drawn", "initial"):
      got = _weights(arrays, name)
      assert [g.shape for g in got] == [r.shape for r in reference], name
      for g, r in zip(got, reference):
        np.testing.assert_array_equal(g, r)


def test_trains_like_one_device_with_whole_weights_on_both_workers(workers):
  expected = _weights(workers[0]["arrays"], "reference")
  initial = _weights(workers[0]["arrays"], "reference_initial")
  # The steps changed the weights, so equality is not trivial.
  assert max(np.abs(e - i).max() for e, i in zip(expected, initial)) > 1e-2
  for measured in workers:
    for name in ("trained", "numpy"):  # get_weights(); w.numpy().
      got = _weights(measured["arrays"], name)
      assert [g.shape for g in got] == [e.shape for e in expected], name
      for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=TOLERANCE)
  for name in ("trained", "numpy"):
    for a, b in zip(_weights(workers[0]["arrays"], name),
                    _weights(workers[1]["arrays"], name)):
      np.testing.assert_array_equal(a, b)


def test_workers_that_drew_differently_are_refused(workers):
  for measured in workers:
    assert "drew different initial values" in (
        measured["different_seeds"] or ""), measured["different_seeds"]
    assert "set_random_seed" in measured["different_seeds"]
