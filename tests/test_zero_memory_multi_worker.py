"""tfpar.ZeRO(stage=3) across 2 TF_CONFIG workers x 2 virtual CPUs takes no
more new collective instance keys per step than plain data parallelism.

TensorFlow's runtime keeps a record (about 300 bytes) for every instance
key it has seen, for the life of the process, and across workers its
launchers take a new key at every call. Stage 3 gathers each weight in the
forward pass and again in the recomputed backward pass, and reduce-scatters
its gradient: before its collectives took fixed keys, 3 new keys per weight,
device and step (40 keys per step on each worker for the test MLP against
plain data parallelism's 6; resident memory grew about 27 KB per step
against 2-3 KB, docs/zero.md). The workers count every key TensorFlow's
`CollectiveKeys` hands out, whichever object asks (zero_memory_worker.py).
"""

import json
import os

import launch_common

WORKER = os.path.join(os.path.dirname(__file__), "workers",
                      "zero_memory_worker.py")
TIMEOUT = 180  # Seconds; the launch takes about 8 on the test machine.
FIRST, LAST = 4, 12  # Steps counted: after the step is traced.


def test_zero3_takes_no_more_collective_keys_than_data_parallelism(
    tmp_path):
  launch_common.launch_ok(WORKER, tmp_path, "keys", FIRST, LAST, "none", 3,
                          timeout=TIMEOUT)
  for task in range(2):
    with open(tmp_path / f"keys_worker{task}.json") as f:
      per_step = json.load(f)
    print(f"worker {task}: new instance keys per step", per_step)
    # Plain data parallelism: gradients, loss and metric, on each device.
    assert per_step["none"] >= 2, per_step
    assert per_step["3"] <= per_step["none"], per_step
