"""Worker script for the multi-worker ZeRO memory tests, run by `tfpar launch`.

Trains `dp_common`'s model on a repeated dataset under a new
DataParallelStrategy on the TF_CONFIG mesh for each stage, in order, and
writes what it measured to `OUT_DIR/<mode>_worker<i>.json`
({stage: value}).

Usage: zero_memory_worker.py OUT_DIR MODE FIRST LAST STAGE [STAGE ...]
  MODE: `keys`: collective instance keys TensorFlow's `CollectiveKeys`
    hands out per step, from the end of step FIRST to the end of step
    LAST (each call counted, whichever object makes it); `slope`: resident
    bytes per step over the same steps (from /proc/self/statm).
  STAGE: `none` (plain data parallelism) or a ZeRO stage, 1 to 3.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top
import tensorflow as tf
from tensorflow.python.distribute import cross_device_utils

import dp_common
import tfpar

_handed_out = []


def _count_instance_keys():
  """Counts every instance key any `CollectiveKeys` hands out."""
  original = cross_device_utils.CollectiveKeys.get_instance_key

  def counting(self, *args, **kwargs):
    _handed_out.append(None)
    return original(self, *args, **kwargs)
  cross_device_utils.CollectiveKeys.get_instance_key = counting


def _resident_bytes():
  with open("/proc/self/statm") as statm:
    return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler(keras.callbacks.Callback):
  """Reads `measure()` at the end of steps `first` and `last`."""

  def __init__(self, measure, first, last):
    super().__init__()
    self.measure, self.first, self.last = measure, first, last
    self.samples = {}

  def on_train_batch_end(self, batch, logs=None):
    if batch in (self.first, self.last):
      self.samples[batch] = self.measure()


def main():
  out_dir, mode = sys.argv[1], sys.argv[2]
  first, last = int(sys.argv[3]), int(sys.argv[4])
  if mode == "keys":
    _count_instance_keys()
    measure = lambda: len(_handed_out)
  else:
    measure = _resident_bytes
  x, y = dp_common.make_data()
  results = {}
  for stage in sys.argv[5:]:
    strategy = tfpar.DataParallelStrategy(  # Before any TensorFlow op.
        tfpar.Mesh.from_cluster_resolver(data=-1))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        dp_common.GLOBAL_BATCH, drop_remainder=True).repeat()
    with strategy.scope():
      model = dp_common.build_model()
    sampler = _Sampler(measure, first, last)
    callbacks = [sampler] + ([tfpar.ZeRO(stage=int(stage))]
                             if stage != "none" else [])
    model.fit(data, steps_per_epoch=last + 1, epochs=1, verbose=0,
              callbacks=callbacks)
    results[stage] = ((sampler.samples[last] - sampler.samples[first]) /
                      (last - first))
    print(mode, stage, results[stage], flush=True)
  task = strategy.mesh.cluster.task_id
  with open(os.path.join(out_dir, f"{mode}_worker{task}.json"), "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
