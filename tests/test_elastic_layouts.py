"""Tensor, pipeline, expert, 3D and ZeRO-1/2 layouts resume their backups
on more and on fewer workers, and a resume may keep the global batch by
accumulating gradients instead of adjusting the per-replica batch.

One chain of launches (real processes on loopback, 4 virtual CPUs per
worker; `workers/elastic_layouts_worker.py` trains every layout in turn in
each process) covers them all: 1 worker trains epoch 0 and crashes after
a step backup, 2 workers resume it (more replicas) and crash in epoch 1
(the last layout, ZeRO-2, is preempted instead: SIGTERM to worker 1, every
worker saves the same step, the job exits 143), 1 worker resumes (fewer)
and finishes. The global batch (16) is kept on
every number of replicas; the last resume of the ZeRO-2 layout keeps it
with 2 gradient-accumulation steps of per-replica batch 2 where the
backup had none (and, on one device, a backup made with accumulation
resumes without it). Every final model equals one device's uninterrupted
training on the same batches to 1e-5.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest

import launch_common
import tfpar
from tfpar import accumulation_change
from tfpar import resume_position

_WORKER = os.path.join(os.path.dirname(__file__), "workers",
                       "elastic_layouts_worker.py")
sys.path.insert(0, os.path.dirname(_WORKER))
import elastic_layouts_worker as worker  # pylint: disable=g-import-not-at-top,wrong-import-position

# Replicas of each layout on 1 and on 2 workers of 4 devices.
_REPLICAS = {"tensor": 2, "pipeline": 2, "expert": 4, "three_d": 1,
             "zero1": 4, "zero2": 4}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  """The output folder and the log of each of the three launches (1, 2,
  then 1 worker); the second ends preempted (exit 143)."""
  out = str(tmp_path_factory.mktemp("elastic_layouts"))
  logs = []
  for part, workers in enumerate((1, 2, 1)):
    run = launch_common.launch(_WORKER, out, part, workers=workers,
                               devices_per_worker=4, timeout=600)
    assert run.returncode == (143 if part == 1 else 0), (
        run.stdout[-4000:] + run.stderr[-2000:])
    logs.append(run.stdout)
  return out, logs


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_a_layout_resumes_on_more_then_fewer_workers(chain, layout):
  out, logs = chain
  replicas = _REPLICAS[layout]
  for part, (now, before) in ((1, (2 * replicas, replicas)),
                              (2, (replicas, 2 * replicas))):
    resumed = (f"on {now} replicas on {3 - part} worker(s), ", "from a "
               f"backup made on {before} replicas on {part} worker(s), ")
    assert any(all(piece in line for piece in resumed)
               for line in logs[part].splitlines()), (
                   layout, part, logs[part][-4000:])
  with open(os.path.join(out, f"{layout}.json")) as f:
    result = json.load(f)
  assert (result["replicas"], result["workers"]) == (replicas, 1)
  assert result["updates"] == worker.EPOCHS * worker.STEPS_PER_EPOCH
  want = _reference_weights(layout)
  assert [np.shape(w) for w in result["weights"]] == [w.shape for w in want]
  difference = max(float(np.abs(np.array(got) - expected).max())
                   for got, expected in zip(result["weights"], want))
  print(f"\n{layout}: final weights differ from one device's by "
        f"{difference:.1e}")
  assert difference < 1e-5


def test_zero_slices_its_optimizer_state_anew_on_each_number_of_workers(
    chain):
  out, _ = chain
  sizes = [int(np.prod(w.shape)) for w in worker.build_model("zero1").weights]
  for layout, part in (("zero1", 0), ("zero1", 1), ("zero1", 2),
                       ("zero2", 0), ("zero2", 2)):
    replicas = _REPLICAS[layout] * (2 if part == 1 else 1)
    with open(os.path.join(out, f"{layout}.bytes{part}.json")) as f:
      held = json.load(f)
    # Each weight's two Adam moments, sliced (padded) over the replicas:
    # 1/4, then 1/8 on 2 workers, then 1/4 again of 2 x 833 floats.
    want = sum(-(-size // replicas) for size in sizes) * 2 * 4
    assert len(held) == 4 and set(held.values()) == {want}, (
        layout, part, held, want)
    print(f"\n{layout} part {part}: {want} bytes of Adam moments per "
          f"device, of {2 * 4 * sum(sizes)} whole")


def test_a_preempted_layout_saves_on_every_worker_and_resumes(chain):
  _, logs = chain
  for task in (0, 1):
    assert (f"[worker {task}] tfpar: preempted (SIGTERM); saved, exiting "
            "with 143" in logs[1]), logs[1][-4000:]
  # SIGTERM to worker 1 before batch 1 of epoch 1: both saved after batch
  # 2 (3 batches, the step after the one in progress), which the resume
  # under 2 accumulation steps finds at batch 6.
  assert (f"[{worker.LAYOUTS[-1]}] tfpar: global batch" in logs[2] and
          "tfpar: resuming at batch 6 of the epoch, on 4 replicas on 1 "
          "worker(s), 8 steps per epoch, gradient_accumulation_steps 2, "
          "from a backup made on 8 replicas on 2 worker(s), 4 steps per "
          "epoch" in logs[2]), logs[2][-4000:]


def test_the_accumulation_resume_says_what_it_adjusted(chain):
  _, logs = chain
  assert (f"[{worker.ACCUMULATES}] tfpar: global batch 16 kept on 4 "
          "replicas: "
          "per-replica batch 2, gradient_accumulation_steps 2 (adjusted)"
          in logs[2]), logs[2][-4000:]


def _reference_weights(layout):
  model = worker.build_model(layout)
  x, y = worker.data(layout)
  model.fit(x, y, batch_size=worker.GLOBAL_BATCH, epochs=worker.EPOCHS,
            shuffle=False, verbose=0)
  return model.get_weights()


def _interrupted(backup_dir, accumulation, save_freq, at):
  """Fits the data-parallel model on one device with `accumulation`
  steps of GLOBAL_BATCH / accumulation examples until the interruption
  before batch `at[1]` of epoch `at[0]`, with step backups."""
  x, y = worker.data("dp")
  model = worker.build_model("dp", accumulation)
  with pytest.raises(RuntimeError, match="interrupted"):
    model.fit(x, y, batch_size=worker.GLOBAL_BATCH // accumulation,
              epochs=worker.EPOCHS, shuffle=False, verbose=0,
              callbacks=[tfpar.BackupAndRestore(backup_dir,
                                                save_freq=save_freq),
                         worker.Interrupt(at, task=0)])


def test_a_resume_drops_the_accumulation_and_refuses_mid_accumulation(
    tmp_path, capsys):
  x, y = worker.data("dp")
  # 2 accumulation steps of 8, the backup after 4 batches (2 updates) of
  # epoch 0; resumed with no accumulation (batch 16): 2 batches skipped.
  _interrupted(str(tmp_path / "whole"), 2, save_freq=2, at=(0, 5))
  resumed = worker.build_model("dp")
  resumed.fit(x, y, batch_size=worker.GLOBAL_BATCH, epochs=worker.EPOCHS,
              shuffle=False, verbose=0,
              callbacks=[tfpar.BackupAndRestore(str(tmp_path / "whole"))])
  assert ("tfpar: resuming at batch 2 of the epoch, on 1 replicas on 1 "
          "worker(s), 4 steps per epoch, from a backup made on 1 replicas "
          "on 1 worker(s), 8 steps per epoch, gradient_accumulation_steps 2"
          in capsys.readouterr().out)
  assert int(resumed.optimizer.iterations.numpy()) == 8
  difference = max(float(np.abs(got - want).max()) for got, want in zip(
      resumed.get_weights(), _reference_weights("dp")))
  print(f"\naccumulation 2 -> none: final weights differ by {difference:.1e}")
  assert difference < 1e-5
  # A backup after 3 batches, half of the second accumulation: refused
  # before anything loads.
  _interrupted(str(tmp_path / "half"), 2, save_freq=3, at=(0, 4))
  refused = worker.build_model("dp")
  before = refused.get_weights()
  with pytest.raises(ValueError, match=r"after 3 batches of the epoch, in "
                     r"the middle of an accumulation of 2, with "
                     r"gradient_accumulation_steps 1"):
    refused.fit(x, y, batch_size=worker.GLOBAL_BATCH, epochs=worker.EPOCHS,
                shuffle=False, verbose=0,
                callbacks=[tfpar.BackupAndRestore(str(tmp_path / "half"))])
  for got, want in zip(refused.get_weights(), before):
    np.testing.assert_array_equal(got, want)


def test_what_a_change_of_accumulation_cannot_keep_is_refused():
  # 6 steps per epoch are not whole accumulations of 4: an update would
  # span two epochs.
  with pytest.raises(ValueError, match="6 steps per epoch are not a whole "
                     "number of accumulations of 4 steps"):
    resume_position.batches_to_skip(
        resume_position.Position(2, 3, 1, replicas=4, workers=2),
        resume_position.Position(0, 6, 4, replicas=1, workers=1))
  # A learning-rate schedule counts micro-steps under accumulation.
  schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5)
  optimizer = keras.optimizers.Adam(schedule, gradient_accumulation_steps=2)
  optimizer.build([keras.Variable([1.0, 2.0])])
  with pytest.raises(ValueError, match=r"gradient_accumulation_steps 1 "
                     r"into optimizer 'adam\w*' with "
                     r"gradient_accumulation_steps 2: its learning-rate "
                     r"schedule counts micro-steps"):
    accumulation_change.converted_store(optimizer, {}, 1, {})
