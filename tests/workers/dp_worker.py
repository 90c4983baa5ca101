"""Worker script for the multi-worker tests, run by `tfpar launch`.

Trains `dp_common`'s model with DataParallelStrategy on the TF_CONFIG mesh
and writes what each worker saw to `<out_dir>/worker<i>.json`.

Usage: dp_worker.py OUT_DIR [--backup DIR] [--die-in-epoch N]
                    [--preempt-in-epoch N] [--zero-stage S] [--accumulate K]
                    [--policy NAME]
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top
import numpy as np

import dp_common
import tfpar


class DieInEpoch(keras.callbacks.Callback):
  """Kills worker 1 in the middle of an epoch, as a crash would."""

  def __init__(self, epoch):
    super().__init__()
    self.epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    task = self.model.distribute_strategy.mesh.cluster.task_id
    if self._epoch == self.epoch and batch == 3 and task == 1:
      os._exit(17)  # pylint: disable=protected-access

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch


class PreemptInEpoch(keras.callbacks.Callback):
  """Sends SIGTERM to worker 1 before batch 3 of an epoch, as a
  preemptible machine's shutdown would."""

  def __init__(self, epoch):
    super().__init__()
    self.epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    task = self.model.distribute_strategy.mesh.cluster.task_id
    if self._epoch == self.epoch and batch == 3 and task == 1:
      os.kill(os.getpid(), signal.SIGTERM)

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("out_dir")
  parser.add_argument("--backup")
  parser.add_argument("--die-in-epoch", type=int)
  parser.add_argument("--preempt-in-epoch", type=int)
  parser.add_argument("--zero-stage", type=int)
  parser.add_argument("--accumulate", type=int)
  parser.add_argument("--policy")
  args = parser.parse_args()

  if args.policy:
    keras.mixed_precision.set_global_policy(args.policy)
  mesh = tfpar.Mesh.from_cluster_resolver(data=-1)
  strategy = tfpar.DataParallelStrategy(mesh)
  with strategy.scope():
    model = dp_common.build_model(
        gradient_accumulation_steps=args.accumulate)
  x, y = dp_common.make_data()
  callbacks = []
  if args.backup:
    callbacks += [tfpar.BackupAndRestore(args.backup),
                  tfpar.ModelCheckpoint(
                      os.path.join(args.backup + "_ckpt", "e{epoch}.weights.h5"),
                      save_weights_only=True)]
  if args.die_in_epoch is not None:
    callbacks.append(DieInEpoch(args.die_in_epoch))
  if args.preempt_in_epoch is not None:
    callbacks.append(PreemptInEpoch(args.preempt_in_epoch))
  if args.zero_stage:
    callbacks.append(tfpar.ZeRO(stage=args.zero_stage))
  history = dp_common.fit(model, x, y, callbacks=callbacks,
                          validation_data=(x[:64], y[:64]))
  result = {
      "num_replicas": strategy.num_replicas_in_sync,
      "local_devices": list(strategy.extended.worker_devices),
      "history": history,
      "evaluate": model.evaluate(x, y, batch_size=32, verbose=0),
      "predict": model.predict(x[:100], batch_size=32, verbose=0).tolist(),
      "weights": [w.tolist() for w in model.get_weights()],
      "optimizer_shapes": [list(v.value.values[0].shape)
                           for v in model.optimizer.variables
                           if hasattr(v.value, "values")],
  }
  # Every worker calls it; the chief writes (under ZeRO the workers gather
  # the optimizer state, and at stage 3 the weights, together).
  tfpar.save_weights(model, os.path.join(args.out_dir, "weights.weights.h5"))
  name = f"worker{mesh.cluster.task_id}.json"
  with open(os.path.join(args.out_dir, name), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
