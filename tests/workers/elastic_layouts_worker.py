"""Worker script of tests/test_elastic_layouts.py, run by `tfpar launch`.

Trains, in turn in one process, a tiny model under each layout of
`LAYOUTS` (tensor, pipeline, expert, 3D, ZeRO-1, ZeRO-2), each with its own
`tfpar.BackupAndRestore(OUT_DIR/<layout>_backup, save_freq=2)`: global
batch 16 (`tfpar.keep_global_batch`), 4 steps per epoch, 2 epochs.

The test launches it three times on the same OUT_DIR (`PART` 0, 1, 2):
part 0 raises before batch 3 of epoch 0 (its backup holds 2 batches),
part 1 resumes and raises before batch 3 of epoch 1 (the last layout:
worker 1 gets SIGTERM before batch 1 of epoch 1, every worker saves the
same step and the job exits 143), part 2 resumes and finishes; the chief
then writes `OUT_DIR/<layout>.json` (the final weights, the optimizer's
updates, the replicas and workers) and, for ZeRO,
`<layout>.bytes<PART>.json` (the bytes of Adam moments on each of its
devices). In part 2 the `ACCUMULATES` layout keeps the global batch by
accumulating gradients (per-replica batch 2) instead of adjusting the
per-replica batch.

Usage: elastic_layouts_worker.py OUT_DIR PART [LAYOUT ...]
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top
import numpy as np

import dp_common
import pp_common
import tfpar
from tfpar import memory
import tp_common

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 4
EPOCHS = 2
INTERRUPT = {0: (0, 3), 1: (1, 3), 2: None}  # Part: (epoch, batch).
PREEMPT = (1, 1)  # Part 1's last layout: SIGTERM before that batch.


def _moe_model():
  tokens = keras.Input((4,), dtype="int32")
  x = keras.layers.Embedding(16, 8, name="tokens")(tokens)
  x = keras.layers.Add()([x, tfpar.MoE(4, 16, top_k=2, name="moe")(x)])
  model = keras.Model(tokens, keras.layers.Dense(16, name="head")(x))
  _deterministic(model, 5)
  return model


def _deterministic(model, seed):
  rng = np.random.default_rng(seed)
  model.set_weights([0.3 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])


def _tokens(rows):
  ids = np.random.default_rng(1).integers(0, 16, size=(rows, 5))
  return ids[:, :-1].astype("int32"), ids[:, 1:].astype("int32")


def data(layout):
  """The (x, y) a layout trains on, STEPS_PER_EPOCH global batches."""
  rows = GLOBAL_BATCH * STEPS_PER_EPOCH
  if layout == "expert":
    return _tokens(rows)
  if layout == "pipeline":
    x, y, _ = pp_common.data(rows)
    return x, y
  if layout in ("tensor", "three_d"):
    return tp_common.data("mlp", count=rows)
  x, y = dp_common.make_data()
  return x[:rows], y[:rows]


def build_model(layout, gradient_accumulation_steps=None):
  """The layout's model, compiled (Adam 0.01): built in the current
  scope."""
  if layout == "expert":
    model = _moe_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  elif layout == "pipeline":
    model, loss = pp_common.residual_chain(blocks=2), "mse"
  elif layout in ("tensor", "three_d"):
    model, loss = tp_common.mlp(), "mse"
  else:
    return dp_common.build_model(
        gradient_accumulation_steps=gradient_accumulation_steps)
  model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
  return model


def strategy_of(layout):
  """The layout's strategy on this job's workers (4 devices each)."""
  resolve = tfpar.Mesh.from_cluster_resolver
  if layout == "tensor":
    return tfpar.TensorParallelStrategy(resolve(data=-1, tensor=2))
  if layout == "pipeline":
    return tfpar.PipelineParallelStrategy(resolve(data=-1, pipeline=2),
                                          num_microbatches=2)
  if layout == "three_d":
    return tfpar.PipelineParallelStrategy(
        resolve(data=-1, pipeline=2, tensor=2), num_microbatches=2)
  if layout == "expert":
    return tfpar.ExpertParallelStrategy(resolve(data=-1), expert=2)
  return tfpar.DataParallelStrategy(resolve(data=-1))


LAYOUTS = ("tensor", "pipeline", "expert", "three_d", "zero1", "zero2")
ACCUMULATES = "zero2"  # Resumes on fewer workers with more accumulation.


class Interrupt(keras.callbacks.Callback):
  """Raises before batch `at[1]` of epoch `at[0]` (a crash of the job);
  with `preempt`, worker 1 sends itself SIGTERM there instead (every
  worker then saves the same step and exits 143)."""

  def __init__(self, at, task, preempt=False):
    super().__init__()
    self.at, self.task, self.preempt = at, task, preempt

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if self.at != (self.epoch, batch):
      return
    if not self.preempt:
      raise RuntimeError(dp_common.INTERRUPTED)
    if self.task == 1:
      os.kill(os.getpid(), signal.SIGTERM)


def slot_bytes(model):
  """{device: bytes} of the Adam moments (sliced under ZeRO) this worker
  holds, counted from each per-device variable's shape."""
  held = {}
  for variable in model.optimizer.variables:
    if variable.name.endswith(("_momentum", "_velocity")):
      for component in memory.components(variable):
        held[component.device] = held.get(component.device, 0) + (
            component.shape.num_elements() * component.dtype.size)
  return held


def run(out_dir, layout, part):
  strategy = strategy_of(layout)
  task = strategy.mesh.cluster.task_id or 0
  log = (lambda line: print(f"[{layout}] {line}", flush=True)) if (
      task == 0) else None
  if layout == ACCUMULATES and part == 2:
    plan = tfpar.keep_global_batch(strategy, GLOBAL_BATCH,
                                   "gradient_accumulation_steps",
                                   per_replica_batch=2, log=log)
  else:
    plan = tfpar.keep_global_batch(strategy, GLOBAL_BATCH, log=log)
  with strategy.scope():
    model = build_model(layout, plan.gradient_accumulation_steps)
  callbacks = []
  if layout.startswith("zero"):
    callbacks.append(tfpar.ZeRO(stage=int(layout[-1])))
  callbacks += [tfpar.BackupAndRestore(
      os.path.join(out_dir, f"{layout}_backup"), save_freq=2)]
  preempt = part == 1 and layout == LAYOUTS[-1]  # Then exits 143.
  callbacks.append(Interrupt(PREEMPT if preempt else INTERRUPT[part], task,
                             preempt=preempt))
  x, y = data(layout)
  finished = dp_common.fit_unless_interrupted(
      model, x, y, batch_size=plan.batch_size, epochs=EPOCHS, shuffle=False,
      verbose=0, callbacks=callbacks)
  if task == 0 and layout.startswith("zero"):
    with open(os.path.join(out_dir, f"{layout}.bytes{part}.json"), "w") as f:
      json.dump(slot_bytes(model), f)
  if not finished:
    return
  weights = model.get_weights()  # Every worker: a gather where split.
  if task == 0:
    with open(os.path.join(out_dir, f"{layout}.json"), "w") as f:
      json.dump({"weights": [w.tolist() for w in weights],
                 "updates": int(model.optimizer.iterations.numpy()),
                 "replicas": strategy.num_replicas_in_sync,
                 "workers": strategy.mesh.num_workers}, f)


def main():
  out_dir, part = sys.argv[1], int(sys.argv[2])
  for layout in sys.argv[3:] or LAYOUTS:
    run(out_dir, layout, part)


if __name__ == "__main__":
  main()
