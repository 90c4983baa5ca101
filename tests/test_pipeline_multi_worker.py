"""A pipeline whose stages sit on 2 TF_CONFIG workers (2 virtual CPUs each),
started by `tfpar launch` on loopback; compared with one device here."""

import json
import os

import numpy as np

import launch_common
import pp_common

WORKER = os.path.join(os.path.dirname(__file__), "workers", "pp_worker.py")
LAUNCH_TIMEOUT = 300


def test_stages_on_two_workers_match_one_device(tmp_path):
  launch_common.launch_ok(WORKER, tmp_path, timeout=LAUNCH_TIMEOUT)
  with open(tmp_path / "chief.json") as f:
    result = json.load(f)
  for stage, devices in result["stage_devices"].items():
    task = 0 if int(stage) < 2 else 1
    assert all(f"/task:{task}/" in d for d in devices), (stage, devices)
  reference = pp_common.one_device()
  pp_common.assert_same_training(reference, (
      result["history"], result["evaluate"],
      np.array(result["predict"], "float32"),
      [np.array(w, "float32") for w in result["weights"]]))
