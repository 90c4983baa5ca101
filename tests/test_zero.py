"""tfpar.ZeRO stages 1-3 over 4 replicas train like one device, keep 1/4
of the state (and at stage 3 of the weights) per device from the first
allocation on, and move the bytes ZeRO's analysis predicts."""

import functools
import json
import math
import os
import subprocess
import sys
import types

import keras
import numpy as np
import pytest

import dp_common
import suite_scope
import tfpar
from zero_common import assert_same_training
from zero_common import data_parallel
from zero_common import model_under
from zero_common import OPTIMIZERS
from zero_common import record_created_variables
from zero_common import STOCK_MIRRORED_SCRIPT

STAGES = (1, 2, 3)
# Runs compared with one device train dp_common.EPOCHS (3) epochs of 8
# batches: 12 updates even with gradient_accumulation_steps=2.
ACCUMULATING = "adam_accumulation_clipnorm"
# Moves only ZeRO's own collectives (clipping would add an all-reduce).
ELEMENTWISE = "adamw_weight_decay"

# Runs shared by the tests that check different things of the same run
# (each made on first use, once per module).


@pytest.fixture(scope="module")
def one_device():
  """name -> (model, epoch losses) of that optimizer on one device."""
  @functools.cache
  def run(name):
    x, y = dp_common.make_data()
    reference = model_under(OPTIMIZERS[name])
    return reference, dp_common.fit(reference, x, y)["loss"]
  return run


@pytest.fixture(scope="module")
def zero_runs():
  """(name, stage) -> that optimizer under data parallelism with ZeRO at
  `stage`, fitted under a CommunicationLog: the model, its epoch losses,
  the log and the (name, shape) of every variable the fit created."""
  @functools.cache
  def run(name, stage):
    x, y = dp_common.make_data()
    model = model_under(OPTIMIZERS[name], data_parallel())
    with pytest.MonkeyPatch.context() as monkeypatch:
      created = record_created_variables(monkeypatch)
      with tfpar.CommunicationLog() as log:
        losses = dp_common.fit_one_iterator(
            model, x, y, callbacks=[tfpar.ZeRO(stage=stage)])["loss"]
    return types.SimpleNamespace(model=model, losses=losses, log=log,
                                 created=created)
  return run


@pytest.fixture(scope="module")
def plain_adam():
  """Adam(0.01) under data parallelism fitted one epoch without ZeRO."""
  x, y = dp_common.make_data()
  model = model_under(lambda: keras.optimizers.Adam(0.01), data_parallel())
  dp_common.fit(model, x, y, epochs=1)
  return model


# Stage 2 differs from stage 1 in its gradients (reduce-scattered, so norm
# clipping needs the norm of every slice), not in its optimizer state: it
# runs the clipping, decay and accumulation optimizers, the others with
# TFPAR_TEST_FULL=1.
_STATE_ONLY = ("adagrad", "adamax", "lion", "nadam")


@pytest.mark.parametrize("name,stage", suite_scope.cases(
    [(name, stage) for name in sorted(OPTIMIZERS) for stage in STAGES
     if not (stage == 2 and name in _STATE_ONLY)],
    [(name, 2) for name in _STATE_ONLY]))
def test_every_stage_trains_like_one_device(name, stage, one_device,
                                            zero_runs):
  reference, expected = one_device(name)
  run = zero_runs(name, stage)
  model = run.model
  assert_same_training(model, reference, run.losses, expected)
  # The state really is sliced: every slot holds 1/4 of its weight.
  sizes = {math.ceil(np.prod(w.shape) / 4) for w in reference.weights}
  slots = [v for v in model.optimizer.variables
           if v.name.endswith(("momentum", "velocity", "accumulator",
                               "average_gradient")) and not (
                                   stage == 1 and "gradient_acc" in v.name)]
  assert slots
  for slot in slots:
    assert len(slot.value.values) == 4 and slot.shape[0] in sizes


def test_every_stage_under_stock_mirrored_strategy(one_device):
  # Stock MirroredStrategy instances of one process share collective keys
  # (tfpar's strategies do not), so this runs in a process of its own.
  reference, expected = one_device("adam_global_clipnorm")
  run = subprocess.run(
      [sys.executable, "-c", STOCK_MIRRORED_SCRIPT,
       os.path.dirname(__file__)],
      capture_output=True, text=True, timeout=400)
  assert run.returncode == 0, run.stderr[-3000:]
  results = [json.loads(line) for line in run.stdout.strip().splitlines()]
  assert [result["stage"] for result in results] == [1, 2, 3]
  for result in results:
    assert max(abs(a - b) for a, b in zip(result["losses"], expected)) < 1e-5
    assert max(float(np.max(np.abs(np.array(a) - b))) for a, b in
               zip(result["weights"], reference.get_weights())) < 1e-5
    assert result["slot_shape"] == [1]  # The 1-element bias's velocity / 4.


@pytest.mark.parametrize("stage", STAGES)
def test_full_size_state_is_never_allocated(stage, zero_runs):
  run = zero_runs(ACCUMULATING, stage)
  model, created = run.model, run.created
  sizes = {w.path.replace("/", "_"): math.ceil(np.prod(w.shape) / 4)
           for w in model.trainable_variables}
  sliced = ("momentum", "velocity") + (
      ("gradient_accumulator",) if stage > 1 else ())
  sliced += ("zero3",) if stage == 3 else ()
  slots = [(n, s) for n, s in created if any(k in n for k in sliced)]
  assert len(slots) >= len(sliced) * len(sizes) * 4  # Every component.
  for name, shape in slots:
    weight = max((k for k in sizes if k + "_" in name), key=len)
    assert shape == (sizes[weight],), (name, shape)


@pytest.mark.parametrize("stage", STAGES)
def test_bytes_per_device_follow_the_zero_formulas(stage, plain_adam,
                                                   zero_runs):
  # (Keras alone cannot accumulate gradients under a tf.distribute
  # strategy: its accumulation calls merge_call inside tf.cond.)
  model = zero_runs(ACCUMULATING, stage).model
  before, after = tfpar.memory_report(plain_adam), tfpar.memory_report(model)
  counters = 8 + 4  # int64 iteration and float32 learning rate.
  whole = sum(4 * int(np.prod(w.shape)) for w in model.trainable_variables)
  sliced = sum(4 * math.ceil(np.prod(w.shape) / 4)
               for w in model.trainable_variables)
  # Adam's two moments and the accumulation buffer, whole or in slices,
  # plus at stages 1-2 the weight slice the update works on.
  expected = {1: 3 * sliced + whole, 2: 4 * sliced, 3: 3 * sliced}[stage]
  estimate = tfpar.zero.estimate_bytes(
      sum(int(np.prod(w.shape)) for w in model.trainable_variables), 4,
      stage, accumulation=True)
  for device in after.devices:
    assert before.optimizer[device] == 2 * whole + counters
    assert before.parameters[device] == whole
    assert after.optimizer[device] == expected + counters
    assert after.parameters[device] == (sliced if stage == 3 else whole)
    # The estimate differs only by the padding of the slices.
    assert abs(after.optimizer[device] - counters -
               estimate.optimizer - estimate.gradient_buffers) <= 4 * 4 * 6
    assert after.parameters[device] - estimate.parameters <= 4 * 6


@pytest.mark.parametrize("stage", STAGES)
def test_collective_bytes_match_zero_analysis(stage, zero_runs):
  model = zero_runs(ELEMENTWISE, stage).model
  moved = zero_runs(ELEMENTWISE, stage).log.bytes()
  # Plain data parallelism: a ring all-reduce sends 2 (N - 1) / N of the
  # gradients from each device.
  parameters = sum(int(np.prod(w.shape)) for w in model.trainable_variables)
  data_parallel_bytes = 2 * 3 / 4 * parameters * 4
  ratio = sum(moved.values()) / data_parallel_bytes
  if stage < 3:
    assert set(moved) == {("reduce-scatter", "optimizer"),
                          ("all-gather", "optimizer")}
    assert ratio == pytest.approx(1.0, abs=0.01)  # Up to slice padding.
  else:
    assert set(moved) == {("all-gather", "forward"),
                          ("all-gather", "backward"),
                          ("reduce-scatter", "backward")}
    assert moved[("all-gather", "forward")] == moved[
        ("all-gather", "backward")] == moved[("reduce-scatter", "backward")]
    assert ratio == pytest.approx(1.5, abs=0.01)


@pytest.mark.parametrize("stage", STAGES)
def test_cpu_offload_keeps_state_and_update_on_the_host(stage, one_device):
  x, y = dp_common.make_data()
  reference, expected = one_device(ACCUMULATING)
  model = model_under(OPTIMIZERS[ACCUMULATING], data_parallel())
  losses = dp_common.fit_one_iterator(
      model, x, y, callbacks=[tfpar.ZeRO(stage=stage, offload="cpu")])["loss"]
  assert_same_training(model, reference, losses, expected)
  host = "/job:localhost/replica:0/task:0/device:CPU:0"
  sliced = [v for v in model.optimizer.variables
            if v.name.endswith(("momentum", "velocity", "zero_slice")) or (
                stage > 1 and v.name.endswith("gradient_accumulator"))]
  assert sliced
  for variable in sliced:
    assert {c.device for c in variable.value.values} == {host}
  # The model stays on the replica devices.
  assert len({c.device for c in model.weights[0].value.values}) == 4


def test_stage3_weights_read_whole_outside_replicas(zero_runs):
  x, _ = dp_common.make_data()
  model = zero_runs(ELEMENTWISE, 3).model  # Changed below: read no later.
  kernel = model.layers[0].kernel
  assert [c.shape[0] for c in kernel.value.values] == [64] * 4
  assert kernel.numpy().shape == (8, 32)
  expected = model.predict(x[:32], verbose=0)
  np.testing.assert_allclose(model(x[:32]).numpy(), expected, atol=1e-6)
  kernel.assign(np.zeros((8, 32), "float32"))
  assert not np.any(kernel.numpy())
  np.testing.assert_allclose(model.predict(x[:32], verbose=0),
                             model(x[:32]).numpy(), atol=1e-6)
  assert not np.allclose(model(x[:32]).numpy(), expected, atol=1e-3)


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 4}, r"stage must be one of \(1, 2, 3\). Received: stage=4"),
    ({"stage": 1, "offload": "nvme"},
     r"offload must be None or 'cpu'. Received: offload='nvme'"),
    ({"bucket_bytes": 0},
     r"bucket_bytes must be a positive integer \(bytes\). Received: "
     r"bucket_bytes=0"),
    ({"bucket_bytes": True}, r"Received: bucket_bytes=True"),
    ({"load_from": "model.h5"},
     r"load_from must be a '.weights.h5' or '.keras' file. Received: "
     r"load_from='model.h5'"),
    ({"load_from": "/nowhere/model.weights.h5"},
     r"load_from must name an existing file. Received: "
     r"load_from='/nowhere/model.weights.h5'"),
])
def test_unknown_settings_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tfpar.ZeRO(**kwargs)


@pytest.mark.parametrize("make, compile_kwargs, message", [
    (lambda: keras.optimizers.Adafactor(0.01), {}, "cannot shard Adafactor"),
    (lambda: keras.optimizers.Adam(0.01, use_ema=True), {},
     "use_ema=True"),
    (lambda: keras.optimizers.Adam(0.01), {"run_eagerly": True},
     "run_eagerly=True"),
])
def test_unshardable_set_ups_are_refused(make, compile_kwargs, message):
  x, y = dp_common.make_data()
  with data_parallel().scope():
    model = dp_common.build_model()
    model.compile(optimizer=make(), loss="mse", **compile_kwargs)
  with pytest.raises(ValueError, match=message):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=2)])


def test_built_optimizer_and_optimizer_outside_scope_are_refused(
    plain_adam):
  x, y = dp_common.make_data()
  with pytest.raises(ValueError, match="needs optimizer .* unbuilt"):
    dp_common.fit(plain_adam, x, y, epochs=1,
                  callbacks=[tfpar.ZeRO(stage=1)])
  optimizer = keras.optimizers.Adam(0.01)
  with data_parallel().scope():
    model = dp_common.build_model()
    model.compile(optimizer=optimizer, loss="mse")
  with pytest.raises(ValueError, match="created outside the model's "
                     "strategy scope"):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])


def test_changing_stage_between_fits_is_refused(zero_runs):
  x, y = dp_common.make_data()
  model = zero_runs(ELEMENTWISE, 2).model  # Fitted once with ZeRO(stage=2).
  dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=2)])
  with pytest.raises(ValueError, match="cannot change to stage=3"):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=3)])
