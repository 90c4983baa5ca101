"""tfpar's data parallelism, with and without tfpar.ZeRO, keeps memory flat
over thousands of steps.

TensorFlow's runtime keeps a record for every collective instance key it
has seen, and its strategies feed a new key to every collective at every
call. tfpar's collectives in one process reuse the keys fixed when the
step is traced, and stage 3's per-weight collectives take keys fixed by
what they move (also across workers, test_zero_memory_multi_worker.py);
these tests count the keys and measure the resident memory of a real
training process.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tensorflow.python.distribute import cross_device_utils

import dp_common
import tfpar
from zero_common import data_parallel


def _keys_per_epoch(stage):
  """{steps: new collective instance keys TensorFlow hands out over an
  epoch of that many steps} for epochs of 8 and 16 steps, once a first
  epoch traced the step."""
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
  dp_common.fit(model, x, y, epochs=1, callbacks=callbacks)
  counts = {}
  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(cross_device_utils.CollectiveKeys,
                        "get_instance_key", counting)
    for times in (1, 2):
      before = len(handed_out)
      dp_common.fit(model, np.tile(x, (times, 1)), np.tile(y, (times, 1)),
                    epochs=1, callbacks=callbacks)
      counts[times * dp_common.STEPS_PER_EPOCH] = len(handed_out) - before
  return counts


@pytest.mark.parametrize("stage", (None, 1, 2, 3))
def test_steps_take_no_new_collective_keys(stage):
  """An epoch of 16 steps takes no more keys than one of 8: the steps'
  collectives reuse their traced keys (TensorFlow's took 4 per step of
  plain data parallelism here, one per device); what is left are the
  eager reads of the metrics' replicas around each epoch."""
  counts = _keys_per_epoch(stage)
  assert counts[16] == counts[8], counts


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
  step: the stage that grew fastest, 28 KB per step before; plain data
  parallelism 1,129-1,550 bytes per step on TensorFlow's keys)."""
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
  assert slopes["none"] < 600, slopes
  assert slopes["3"] - slopes["none"] < 2048, slopes
