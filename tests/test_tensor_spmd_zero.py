"""tfpar.ZeRO under TensorParallelStrategy(spmd=True): each tensor column
(the devices with the same tensor index across data replicas) slices its
devices' optimizer state (stage 1), gradients (stage 2) and weights
(stage 3) over the data replicas, as Megatron + DeepSpeed run ZeRO over
each tensor rank's data-parallel group; with `offload="cpu"` the state
lives on the host.

The one-block GPT of tp_common at data 2 x tensor 2 is compared with the
same model fitted on one device with the same optimizer: every step's
loss and every whole weight; the optimizer slots (and under stage 3 the
weights) each device holds are counted from the variables' components and
held to the ZeRO formula; the saved optimizer state equals one device's,
and loads back.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar._compat import keras_layers
import suite_scope
import tp_common

STEPS = 6
LAYOUT = {"data": 2, "tensor": 2}
# The optimizer's settings: clipping per weight and accumulation (whole
# accumulators at stage 1, saved column by column), or global clipping
# with the embeddings' sparse gradients.
PER_WEIGHT = dict(clipnorm=0.02, gradient_accumulation_steps=2)
GLOBAL = dict(global_clipnorm=0.1)
# (stage, offload) -> its settings; runs of equal settings share their
# one-device reference.
CASES = {(1, None): PER_WEIGHT, (2, None): GLOBAL, (3, None): GLOBAL}
# TFPAR_TEST_FULL=1 adds stage 3 under sequence parallelism (its calls
# are not recomputed there) and offload at stages 1 and 3 (test_zero and
# the precision matrix offload under data parallelism: the same host
# update).
EXTRA = {(3, None, "sequence"): GLOBAL, (1, "cpu"): PER_WEIGHT,
         (3, "cpu"): GLOBAL}
CASES.update({c: EXTRA[c] for c in suite_scope.cases([], EXTRA)})
IDS = ["-".join(str(part) for part in case if part) for case in CASES]


def _model(settings):
  keras.utils.set_random_seed(0)
  model = tp_common.gpt(blocks=1)
  model.compile(
      optimizer=keras.optimizers.Adam(0.01, **settings),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _data():
  return tp_common.data("gpt", count=tp_common.BATCH * STEPS)


def _strategy(sequence_parallel=False):
  devices = tf.config.list_logical_devices("CPU")[:4]
  return tfpar.TensorParallelStrategy(
      tfpar.Mesh(LAYOUT, [d.name for d in devices]), spmd=True,
      sequence_parallel=sequence_parallel)


@pytest.fixture(scope="module")
def runs():
  """(stage, offload) -> (reference, its losses, strategy, model, its
  losses)."""
  references, done = {}, {}

  def run(case):
    settings = CASES[case]
    key = tuple(sorted(settings.items()))
    if key not in references:
      reference = _model(settings)
      references[key] = (reference, tp_common.step_losses(
          reference, *_data(), epochs=1))
    if case not in done:
      strategy = _strategy(sequence_parallel="sequence" in case)
      with strategy.scope():
        model = _model(settings)
      stage, offload = case[:2]
      losses = tp_common.step_losses(
          model, *_data(), epochs=1,
          callbacks=[tfpar.ZeRO(stage=stage, offload=offload)])
      done[case] = (*references[key], strategy, model, losses)
    return done[case]
  return run


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_trains_like_one_device(runs, case):
  reference, expected, _, model, losses = runs(case)
  assert len(losses) == STEPS
  tp_common.assert_trains_like(model, losses, reference, expected)


def _device(name):
  spec = tf.DeviceSpec.from_string(name)
  return f"{spec.device_type}:{spec.device_index}"


def _held(variables, devices):
  """Bytes of `variables`' per-device components on each of `devices`."""
  held = dict.fromkeys(devices, 0)
  for variable in variables:
    for component in keras_layers.storage(variable).values:
      held[_device(component.device)] += (
          component.shape.num_elements() * component.dtype.size)
  return held


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_each_device_holds_its_slice_of_its_shards_state(runs, case):
  _, _, strategy, model, _ = runs(case)
  stage, offload = case[:2]
  data = LAYOUT["data"]
  devices = [_device(d) for g in strategy.mesh.replicas for d in g]
  trainable = model.trainable_variables
  # 1/data of each trainable variable (a split weight's is its shard).
  sliced = sum(4 * math.ceil(v.shape.num_elements() / data)
               for v in trainable)
  whole = sum(4 * v.shape.num_elements() for v in trainable)
  # Up to the padding of one slice (< 1 element per variable).
  assert 0 <= sliced - whole / data < 4 * len(trainable)
  # Counted from the optimizer's variables' per-device components: each
  # trainable variable has Adam's two moments and (stages 1-2) the updated
  # weight slice in 1/data slices, one per device (all on the host CPU,
  # here the first device, with offload); stage 1's gradient accumulators
  # are whole shards, on the devices.
  variables = model.optimizer.variables
  slots = [v for v in variables
           if v.name.endswith(("_momentum", "_velocity", "_zero_slice"))]
  assert len(slots) == (2 if stage == 3 else 3) * len(trainable)
  per_device = len(slots) // len(trainable) * sliced
  held = _held(slots, devices)
  if offload is None:
    assert held == dict.fromkeys(devices, per_device)
  else:
    assert held == {d: len(devices) * per_device if d == devices[0] else 0
                    for d in devices}
  accumulators = [v for v in variables
                  if v.name.endswith("_gradient_accumulator")]
  if "gradient_accumulation_steps" in CASES[case]:
    assert _held(accumulators, devices) == dict.fromkeys(
        devices, whole if stage == 1 else sliced)
  # The weights: every device its whole shard (or replicated weight) at
  # stages 1-2; stage 3 holds it once over the data axis, 1/data each.
  assert _held(trainable, devices) == dict.fromkeys(
      devices, sliced if stage == 3 else whole)
  # Against the same model's slots without ZeRO (every device: 2 x whole
  # for Adam's moments).
  assert per_device < 2 * whole


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_saved_optimizer_state_is_one_devices(runs, case, tmp_path):
  reference, _, _, model, _ = runs(case)
  path = str(tmp_path / "zero.weights.h5")
  model.save_weights(path)
  loaded = _model(CASES[case])
  loaded.optimizer.build(loaded.trainable_variables)
  loaded.load_weights(path)
  tp_common.assert_same_optimizer_state(loaded, reference)
  # And back: one device's state loaded into the ZeRO model saves again
  # as it was (every column's slices written).
  path = str(tmp_path / "one_device.weights.h5")
  reference.save_weights(path)
  model.load_weights(path)
  again = str(tmp_path / "again.weights.h5")
  model.save_weights(again)
  loaded.load_weights(again)
  for got, want in zip(loaded.optimizer.variables,
                       reference.optimizer.variables):
    np.testing.assert_array_equal(got.numpy(), want.numpy(),
                                  err_msg=want.path)
  for got, want in zip(loaded.get_weights(), reference.get_weights()):
    np.testing.assert_array_equal(got, want)


def test_zero_option_applies_zero_without_a_callback(runs):
  # TensorParallelStrategy(zero=tfpar.ZeRO(stage=3)) does what the callback
  # does (a keras.distribution layout map over both axes folds into it):
  # the same losses and weights, the same slices on every device.
  reference, expected, _, callback_model, _ = runs((3, None))
  devices = tf.config.list_logical_devices("CPU")[:4]
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh(LAYOUT, [d.name for d in devices]),
      zero=tfpar.ZeRO(stage=3))
  with strategy.scope():
    model = _model(CASES[(3, None)])
  losses = tp_common.step_losses(model, *_data(), epochs=1)
  tp_common.assert_trains_like(model, losses, reference, expected)
  names = [_device(d.name) for d in devices]
  assert _held(model.trainable_variables, names) == _held(
      callback_model.trainable_variables, names)
  assert _held(model.optimizer.variables, names) == _held(
      callback_model.optimizer.variables, names)
  with pytest.raises(ValueError, match=r"zero must be None or a tfpar.ZeRO"):
    tfpar.TensorParallelStrategy(tfpar.Mesh(LAYOUT), zero=3)
