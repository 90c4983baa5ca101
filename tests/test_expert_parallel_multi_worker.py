"""ExpertParallelStrategy across 2 `TF_CONFIG` workers x 2 virtual CPUs
(real processes started by `tfpar launch` on loopback ports)."""

import json
import os

import launch_common

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ep_worker.py")
TIMEOUT = 300


def test_expert_groups_inside_and_across_workers_train_like_one_device(
    tmp_path):
  launch_common.launch_ok(WORKER, tmp_path, timeout=TIMEOUT)
  for task in (0, 1):
    with open(tmp_path / f"worker{task}.json") as f:
      result = json.load(f)
    # Expert 2: each expert group is one worker's 2 replicas; the
    # expert-data groups (replicas 0, 2 and 1, 3) span the workers.
    assert result["2"]["losses"] < 1e-5, result
    assert result["2"]["weights"] < 1e-5, result
    # Expert 4: tokens cross workers in the all-to-alls, and get_weights
    # gathers each whole expert weight from both workers.
    assert result["4"]["losses"] < 1e-5, result
    assert result["4"]["weights"] < 1e-4, result  # Adam (test_moe_layer).
    # Expert 2 x tensor 2 (SPMD): each device routes its copy of its
    # worker's tokens and exchanges its column's expert rows across the
    # workers; whole experts are gathered from every device of both.
    assert result["2x2"]["losses"] < 1e-5, result
    assert result["2x2"]["weights"] < 1e-4, result
    for expert in ("2", "4", "2x2"):
      assert result[expert]["shapes"], result
      # model.weights lists one device's shapes; their values are whole.
      assert result[expert]["listed"] is not False, result
      assert result[expert]["listed"] == 0.0, result
      if task == 0:  # What tfpar.save_weights wrote loads on one device.
        assert result[expert]["saved"] == 0.0, result
