"""Worker script for tests/test_hangs.py: one way for a job to get stuck.

Trains `dp_common`'s model with DataParallelStrategy on the TF_CONFIG mesh
and prints `EVENT {json}` lines (with wall-clock times) on stdout:
`strategy` before the strategy is created, `stall` just before this worker
gets stuck, `error` with the error's class and message, `done`.

Usage: hang_worker.py SCENARIO, one of
  connect         just train (the test starts only some of the workers);
  sleep           worker 1 sleeps before its batch 3 (alive, heartbeating);
  stop            worker 1 stops itself (SIGSTOP) before its batch 3;
  chief-dies      worker 0 exits before its batch 3;
  extra-strategy  worker 0 creates one strategy more than the others;
  save-skipped    both train under tfpar.ZeRO(stage=2), then worker 0
                  saves (every worker must: the slices are gathered) and
                  worker 1 sleeps instead.
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

SCENARIO = sys.argv[1]
TASK = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def event(name, **fields):
  print("EVENT " + json.dumps(dict(fields, event=name, task=TASK,
                                   time=time.time())), flush=True)


class Stall(keras.callbacks.Callback):
  """Gets this worker stuck before batch 3, as the scenario says."""

  def on_train_batch_begin(self, batch, logs=None):
    if batch != 3:
      return
    if SCENARIO in ("sleep", "stop") and TASK == 1:
      event("stall")
      if SCENARIO == "sleep":
        time.sleep(3600)
      os.kill(os.getpid(), signal.SIGSTOP)
    if SCENARIO == "chief-dies" and TASK == 0:
      event("stall")
      os._exit(9)  # pylint: disable=protected-access


def main():
  event("strategy")
  try:
    if SCENARIO == "extra-strategy" and TASK == 0:
      tfpar.DataParallelStrategy(tfpar.Mesh.from_cluster_resolver(data=-1))
    strategy = tfpar.DataParallelStrategy(
        tfpar.Mesh.from_cluster_resolver(data=-1))
    with strategy.scope():
      model = dp_common.build_model()
    x, y = dp_common.make_data()
    zero = [tfpar.ZeRO(stage=2)] if SCENARIO == "save-skipped" else []
    dp_common.fit(model, x, y, epochs=1, callbacks=[Stall()] + zero)
    if SCENARIO == "save-skipped":
      if TASK == 1:
        event("stall")
        time.sleep(3600)
      tfpar.save_weights(model, os.path.join(
          os.environ["HANG_DIR"], "saved.weights.h5"))
  except Exception as error:  # pylint: disable=broad-except
    event("error", type=type(error).__name__, message=str(error))
    sys.exit(1)
  event("done")


if __name__ == "__main__":
  main()
