"""The README demo: the example trains and learns, on one host."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_example_trains_data_parallel_on_virtual_cpus():
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "examples", "train_data_parallel.py"),
       "--epochs=2", "--examples=2048"],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, TF_CONFIG=""))
  assert run.returncode == 0, run.stderr[-3000:]
  last = run.stdout.strip().splitlines()[-1]
  assert last.startswith("4 replicas on 1 worker(s): validation loss")
  accuracy = float(last.rsplit(" ", 1)[-1])
  # 10 classes: chance is 0.1. Seeded (the example's --seed=0): 0.551 on 2
  # AMD EPYC cores; unseeded, 2 epochs ended anywhere in 0.49-0.61.
  assert accuracy > 0.4
