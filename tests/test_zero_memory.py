"""tfpar.ZeRO keeps memory flat over thousands of steps, as plain data
parallelism does.

TensorFlow's runtime keeps a record for every collective instance key it
has seen, and its strategies feed a new key to every collective at every
call. ZeRO's collectives reuse the keys fixed when the step is traced (one
process) and travel in buckets, and stage 3's per-weight collectives take
keys fixed by what they move (also across workers,
test_zero_memory_multi_worker.py); these tests count the keys and measure
the resident memory of a real training process.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from tensorflow.python.distribute import cross_device_utils

import dp_common
import tfpar
from zero_common import data_parallel

EPOCHS = 3


def _keys_per_epoch(stage):
  """New collective instance keys per epoch once training runs steadily."""
  handed_out = []
  original = cross_device_utils.CollectiveKeys.get_instance_key

  def counting(self, *args, **kwargs):
    handed_out.append(None)
    return original(self, *args, **kwargs)
  strategy = data_parallel()
  with strategy.scope():
    model = dp_common.build_model()
  x, y = dp_common.make_data()
  callbacks = [tfpar.ZeRO(stage=stage)] if stage else []
  counts = []
  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(cross_device_utils.CollectiveKeys,
                        "get_instance_key", counting)
    for _ in range(EPOCHS):
      before = len(handed_out)
      dp_common.fit(model, x, y, epochs=1, callbacks=callbacks)
      counts.append(len(handed_out) - before)
  return counts[1:]  # The first epoch traces the step.


@pytest.fixture(scope="module")
def plain_keys():
  """_keys_per_epoch of plain data parallelism, the stages' yardstick."""
  return _keys_per_epoch(None)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_zero_takes_no_more_collective_keys_than_data_parallelism(
    stage, plain_keys):
  zero = _keys_per_epoch(stage)
  # Plain data parallelism: a few keys per step (gradients, loss, metrics).
  assert all(count >= dp_common.STEPS_PER_EPOCH
             for count in plain_keys), plain_keys
  assert all(count <= min(plain_keys) for count in zero), (plain_keys, zero)


SLOPE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import conftest  # 4 virtual CPUs.
    import keras, tensorflow as tf, tfpar, dp_common

    def resident_bytes():
      with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

    class Sampler(keras.callbacks.Callback):
      def __init__(self):
        super().__init__()
        self.samples = {}
      def on_train_batch_end(self, batch, logs=None):
        if batch in (START, END):
          self.samples[batch] = resident_bytes()

    START, END = int(sys.argv[2]), int(sys.argv[3])
    x, y = dp_common.make_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        dp_common.GLOBAL_BATCH, drop_remainder=True).repeat()
    for stage in sys.argv[4:]:
      strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
      with strategy.scope():
        model = dp_common.build_model()
      sampler = Sampler()
      callbacks = [sampler] + ([tfpar.ZeRO(stage=int(stage))]
                               if stage != "none" else [])
      model.fit(data, steps_per_epoch=END + 1, epochs=1, verbose=0,
                callbacks=callbacks)
      slope = (sampler.samples[END] - sampler.samples[START]) / (END - START)
      print("SLOPE", stage, slope, flush=True)
""")


def test_zero_memory_stays_flat_like_data_parallelism(tmp_path):
  """Resident memory per step over 1,500 steps of a real process, plain
  data parallelism then ZeRO-3 (one collective key per weight, gather and
  step: the stage that grew fastest, 28 KB per step before)."""
  script = tmp_path / "slope.py"
  script.write_text(SLOPE_SCRIPT)
  tests = os.path.dirname(os.path.abspath(__file__))
  result = subprocess.run(
      [sys.executable, str(script), tests, "500", "2000", "none", "3"],
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  slopes = {line.split()[1]: float(line.split()[2])
            for line in result.stdout.splitlines()
            if line.startswith("SLOPE")}
  print("resident bytes per step:", slopes)
  assert slopes["3"] - slopes["none"] < 2048, slopes
