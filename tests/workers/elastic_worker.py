"""Worker script of the elastic tests, run by `tfpar launch [--elastic]`.

Trains `dp_common`'s MLP on 192 examples, global batch 24 (kept on every
number of replicas with `tfpar.keep_global_batch`), 3 epochs, with
`tfpar.BackupAndRestore(OUT_DIR/<layout>_backup, save_freq=2)`, once per
layout named, in order. A layout whose result file exists is skipped (a
restarted job does not train it again). The chief writes
`OUT_DIR/<layout>.json`: the final weights, the optimizer's iterations,
the replicas and workers of the run that finished.

Usage: elastic_worker.py OUT_DIR LAYOUT[,OPTION=VALUE ...] ...
  LAYOUT: dp (`DataParallelStrategy`) or zero3 (with `tfpar.ZeRO(stage=3)`).
    one_sided_read instead: worker 1 leaves after a ZeRO-3 fit, the chief
    calls `get_weights()` alone and writes the error to one_sided.json.
  interrupt=E.B: every worker raises before batch B of epoch E (a crash
    of the whole job; the worker goes on to the next layout).
  kill=R.E.B: on the job's restart R (`TFPAR_ELASTIC_RESTART`), worker 1
    kills itself (SIGKILL) before batch B of epoch E, after writing the time
    to `OUT_DIR/killed.R`; the first batch a restart trains writes the time
    to `OUT_DIR/training.R`.
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top

import dp_common
import tfpar

GLOBAL_BATCH = 24
EXAMPLES = 192
EPOCHS = 3
RESTART = int(os.environ.get("TFPAR_ELASTIC_RESTART", "0"))


def data():
  x, y = dp_common.make_data()
  return x[:EXAMPLES], y[:EXAMPLES]


class Events(keras.callbacks.Callback):
  """The interruptions and the times of the scenario."""

  def __init__(self, out_dir, task, interrupt=None, kill=None):
    super().__init__()
    self.out_dir, self.task = out_dir, task
    self.interrupt, self.kill = interrupt, kill
    self.trained = False

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if self.interrupt == (self.epoch, batch):
      raise RuntimeError(dp_common.INTERRUPTED)
    if self.kill == (RESTART, self.epoch, batch) and self.task == 1:
      with open(os.path.join(self.out_dir, f"killed.{RESTART}"), "w") as f:
        f.write(repr(time.time()))
      os.kill(os.getpid(), signal.SIGKILL)

  def on_train_batch_end(self, batch, logs=None):
    # Batches the backup holds are skipped: their logs are empty.
    if (RESTART and not self.trained and logs and "loss" in logs and
        self.task == 0):
      self.trained = True
      with open(os.path.join(self.out_dir, f"training.{RESTART}"), "a") as f:
        f.write(repr(time.time()) + "\n")


def _position(text):
  return tuple(int(part) for part in text.split("."))


def run(out_dir, layout, options):
  strategy = tfpar.DataParallelStrategy(
      tfpar.Mesh.from_cluster_resolver(data=-1))
  task = strategy.mesh.cluster.task_id or 0
  plan = tfpar.keep_global_batch(strategy, GLOBAL_BATCH,
                                 log=print if task == 0 else None)
  with strategy.scope():
    model = dp_common.build_model()
  callbacks = [tfpar.ZeRO(stage=3)] if layout == "zero3" else []
  callbacks += [
      tfpar.BackupAndRestore(os.path.join(out_dir, f"{layout}_backup"),
                             save_freq=2),
      Events(out_dir, task,
             _position(options["interrupt"]) if "interrupt" in options
             else None,
             _position(options["kill"]) if "kill" in options else None)]
  x, y = data()
  if not dp_common.fit_unless_interrupted(
      model, x, y, batch_size=plan.batch_size, epochs=EPOCHS, shuffle=False,
      verbose=0, callbacks=callbacks):
    return
  weights = model.get_weights()  # Every worker: a gather under ZeRO-3.
  if task == 0:
    with open(os.path.join(out_dir, f"{layout}.json"), "w") as f:
      json.dump({"weights": [w.tolist() for w in weights],
                 "iterations": int(model.optimizer.iterations.numpy()),
                 "replicas": strategy.num_replicas_in_sync,
                 "workers": strategy.mesh.num_workers}, f)


def one_sided_read(out_dir):
  """Worker 1 leaves after training under ZeRO-3; the chief then calls
  `get_weights()` alone and writes the error it got."""
  strategy = tfpar.DataParallelStrategy(
      tfpar.Mesh.from_cluster_resolver(data=-1))
  with strategy.scope():
    model = dp_common.build_model()
  x, y = data()
  model.fit(x[:48], y[:48], batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
            callbacks=[tfpar.ZeRO(stage=3)])
  if strategy.mesh.cluster.task_id == 1:
    os._exit(0)  # pylint: disable=protected-access
  time.sleep(2)
  started = time.monotonic()
  try:
    model.get_weights()
    error = None
  except Exception as failure:  # pylint: disable=broad-except
    error = f"{type(failure).__name__}: {failure}"
  with open(os.path.join(out_dir, "one_sided.json"), "w") as f:
    json.dump({"error": error, "seconds": time.monotonic() - started}, f)
  os._exit(0)  # pylint: disable=protected-access


def main():
  out_dir = sys.argv[1]
  for scenario in sys.argv[2:]:
    layout, *options = scenario.split(",")
    if layout == "one_sided_read":
      one_sided_read(out_dir)
    if os.path.exists(os.path.join(out_dir, f"{layout}.json")):
      continue
    run(out_dir, layout, dict(option.split("=", 1) for option in options))


if __name__ == "__main__":
  main()
