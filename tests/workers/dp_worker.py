"""Worker script for the multi-worker tests, run by `tfpar launch`.

Trains `dp_common`'s model under a new DataParallelStrategy on the
TF_CONFIG mesh for each scenario, in order, so that several scenarios pay
TensorFlow's start and the cluster's connection once (and every strategy
after the first reuses the process's collective server). Each scenario writes
what each worker saw to `OUT_DIR/<name>_worker<i>.json` and the chief's
weights to `OUT_DIR/<name>.weights.h5`.

Usage: dp_worker.py OUT_DIR SCENARIO [SCENARIO ...]
  SCENARIO: NAME[,OPTION=VALUE ...], with the options
    backup=DIR: `tfpar.BackupAndRestore` in `OUT_DIR/DIR` (the JSON
      records the backup's metadata it resumed from, or None), and
      `tfpar.ModelCheckpoint` of every epoch in `OUT_DIR/<NAME>_ckpt`;
    die_in_epoch=N: worker 1 exits with code 17 before batch 3 of epoch N;
    preempt_in_epoch=N: SIGTERM to worker 1 before batch 3 of epoch N;
    zero_stage=S: `tfpar.ZeRO(stage=S)`;
    accumulate=K: Adam accumulates gradients over K batches;
    policy=NAME: the Keras mixed precision policy.
  The scenario `other_cluster` instead writes `OUT_DIR/other_cluster.json`
  with the error of a strategy for another TF_CONFIG (worker 0's port + 1).
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top

import dp_common
import tfpar

_INTEGER_OPTIONS = ("die_in_epoch", "preempt_in_epoch", "zero_stage",
                    "accumulate")


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


def _parse(scenario):
  name, *options = scenario.split(",")
  options = dict(option.split("=", 1) for option in options)
  for key in _INTEGER_OPTIONS:
    if key in options:
      options[key] = int(options[key])
  return name, options


def _callbacks(out_dir, name, options):
  callbacks = []
  if "backup" in options:
    callbacks += [
        tfpar.BackupAndRestore(os.path.join(out_dir, options["backup"])),
        tfpar.ModelCheckpoint(
            os.path.join(out_dir, f"{name}_ckpt", "e{epoch}.weights.h5"),
            save_weights_only=True)]
  if "die_in_epoch" in options:
    callbacks.append(DieInEpoch(options["die_in_epoch"]))
  if "preempt_in_epoch" in options:
    callbacks.append(PreemptInEpoch(options["preempt_in_epoch"]))
  if "zero_stage" in options:
    callbacks.append(tfpar.ZeRO(stage=options["zero_stage"]))
  return callbacks


def _backup_metadata(backup_dir):
  """The metadata of the backup in `backup_dir` (None: no backup)."""
  path = os.path.join(backup_dir, "training_metadata.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _run(strategy, out_dir, name, options):
  keras.mixed_precision.set_global_policy(options.get("policy", "float32"))
  with strategy.scope():
    model = dp_common.build_model(
        gradient_accumulation_steps=options.get("accumulate"))
  x, y = dp_common.make_data()
  resumed_from = (_backup_metadata(os.path.join(out_dir, options["backup"]))
                  if "backup" in options else None)
  history = dp_common.fit(model, x, y,
                          callbacks=_callbacks(out_dir, name, options),
                          validation_data=(x[:64], y[:64]))
  result = {
      "resumed_from": resumed_from,
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
  tfpar.save_weights(model, os.path.join(out_dir, f"{name}.weights.h5"))
  if name == "plain":
    result["looped_fit"] = _looped_fit_refusal(strategy, model, x, y)
  task = strategy.mesh.cluster.task_id
  path = os.path.join(out_dir, f"{name}_worker{task}.json")
  with open(path, "w") as f:
    json.dump(result, f)


def _looped_fit_refusal(strategy, model, x, y):
  """The error of a `fit` compiled with `steps_per_execution=2` (refused
  across workers) and the datasets it distributed (none: before any
  work)."""
  distributed = strategy.extended.datasets_distributed
  with strategy.scope():
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
  try:
    model.fit(x[:32], y[:32], batch_size=32, verbose=0)
    error = None
  except ValueError as refused:
    error = str(refused)
  return {"error": error,
          "distributed": strategy.extended.datasets_distributed - distributed}


def _other_cluster(out_dir):
  """Writes the error of a strategy for a TF_CONFIG other than the one this
  process's collective server serves (None if there was none)."""
  config = json.loads(os.environ["TF_CONFIG"])
  host, port = config["cluster"]["worker"][0].rsplit(":", 1)
  config["cluster"]["worker"][0] = f"{host}:{int(port) + 1}"
  os.environ["TF_CONFIG"] = json.dumps(config)
  try:
    tfpar.DataParallelStrategy(tfpar.Mesh.from_cluster_resolver(data=-1))
    error = None
  except ValueError as refused:
    error = str(refused)
  with open(os.path.join(out_dir, "other_cluster.json"), "w") as f:
    json.dump({"error": error, "tf_config": config}, f)


def main():
  out_dir, scenarios = sys.argv[1], [_parse(s) for s in sys.argv[2:]]
  for name, options in scenarios:  # A strategy each, as a notebook makes.
    if name == "other_cluster":
      _other_cluster(out_dir)
      continue
    strategy = tfpar.DataParallelStrategy(
        tfpar.Mesh.from_cluster_resolver(data=-1))
    _run(strategy, out_dir, name, options)


if __name__ == "__main__":
  main()
