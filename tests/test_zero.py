"""tfpar.ZeRO(stage=1): optimizer state sharded over 4 replicas trains like
one device, takes 1/4 of the optimizer memory per device from the first
allocation on, and checkpoints whole optimizer state."""

import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import dp_common
import tfpar

OPTIMIZERS = {
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(
        0.05, momentum=0.9, clipnorm=0.5),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=1.0),
    "adamw_weight_decay": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.005, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "lion": lambda: keras.optimizers.Lion(0.003),
}
STRATEGIES = {
    "tfpar_data_parallel": lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 4})),
}
# Stock MirroredStrategy instances of one process share collective keys
# (tfpar's strategies do not), so that case runs in a process of its own.
_STOCK_MIRRORED = """
import sys
sys.path.insert(0, sys.argv[1])
import conftest, keras, numpy as np, tensorflow as tf
import dp_common, tfpar
x, y = dp_common.make_data()
def model(strategy=None):
  def build():
    m = dp_common.build_model()
    m.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=1.0),
              loss="mse")
    return m
  if strategy is None:
    return build()
  with strategy.scope():
    return build()
reference = model()
expected = dp_common.fit(reference, x, y)["loss"]
zero = model(tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)]))
losses = dp_common.fit(zero, x, y, callbacks=[tfpar.ZeRO(stage=1)])["loss"]
print(max(abs(a - b) for a, b in zip(losses, expected)),
      max(float(np.max(np.abs(a - b))) for a, b in
          zip(zero.get_weights(), reference.get_weights())),
      tuple(zero.optimizer.variables[2].shape))
"""


def _model(make_optimizer, strategy=None, seed=1):
  def build():
    model = dp_common.build_model(seed=seed)
    model.compile(optimizer=make_optimizer(), loss="mse")
    return model
  if strategy is None:
    return build()
  with strategy.scope():
    return build()


def test_stage1_under_stock_mirrored_strategy_trains_like_one_device():
  run = subprocess.run(
      [sys.executable, "-c", _STOCK_MIRRORED, os.path.dirname(__file__)],
      capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  loss_difference, weight_difference, slot_shape = run.stdout.split(" ", 2)
  assert float(loss_difference) < 1e-5
  assert float(weight_difference) < 1e-5
  assert slot_shape.strip() == "(64,)"  # The 8 x 32 kernel's momentum / 4.


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stage1_trains_like_one_device(name, strategy_name):
  x, y = dp_common.make_data()
  reference = _model(OPTIMIZERS[name])
  expected = dp_common.fit(reference, x, y)["loss"]
  model = _model(OPTIMIZERS[name], STRATEGIES[strategy_name]())
  losses = dp_common.fit(model, x, y, callbacks=[tfpar.ZeRO(stage=1)])["loss"]
  np.testing.assert_allclose(losses, expected, atol=1e-5, rtol=0)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  # The state really is sliced: every slot holds 1/4 of its weight.
  slots = [v for v in model.optimizer.variables if len(v.shape) == 1 and
           v.name.endswith(("momentum", "velocity", "accumulator",
                            "average_gradient"))]
  assert slots
  for slot in slots:
    assert len(slot.value.values) == 4


def _created_variables():
  created = []

  def record(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    created.append((variable.name, tuple(variable.shape)))
    return variable
  return created, record


def test_full_size_optimizer_state_is_never_allocated():
  x, y = dp_common.make_data()
  strategy = STRATEGIES["tfpar_data_parallel"]()
  model = _model(lambda: keras.optimizers.Adam(0.01), strategy)
  created, record = _created_variables()
  with tf.variable_creator_scope(record):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])
  sizes = {w.path.replace("/", "_"): math.ceil(np.prod(w.shape) / 4)
           for w in model.trainable_variables}
  slots = [(n, s) for n, s in created if "momentum" in n or "velocity" in n]
  assert len(slots) >= 2 * len(sizes) * 4  # Every component of every slot.
  for name, shape in slots:
    weight = max((k for k in sizes if k + "_" in name), key=len)
    assert shape == (sizes[weight],), (name, shape)


def test_optimizer_bytes_per_device_are_a_quarter():
  x, y = dp_common.make_data()
  plain = _model(lambda: keras.optimizers.Adam(0.01),
                 STRATEGIES["tfpar_data_parallel"]())
  dp_common.fit(plain, x, y, epochs=1)
  model = _model(lambda: keras.optimizers.Adam(0.01),
                 STRATEGIES["tfpar_data_parallel"]())
  dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])
  before, after = tfpar.memory_report(plain), tfpar.memory_report(model)
  counters = 8 + 4  # int64 iteration and float32 learning rate.
  slices = sum(math.ceil(np.prod(w.shape) / 4) * 4
               for w in model.trainable_variables)
  for device in after.devices:
    assert before.optimizer[device] == 2 * before.parameters[device] + (
        counters)
    # Adam's two moments and the weight slice it updates, 1/4 each.
    assert after.optimizer[device] == 3 * slices + counters
    assert after.optimizer[device] < 0.4 * before.optimizer[device]


def test_checkpoint_holds_whole_state_and_resumes_without_zero(tmp_path):
  x, y = dp_common.make_data()
  model = _model(lambda: keras.optimizers.Adam(0.01),
                 STRATEGIES["tfpar_data_parallel"]())
  dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])
  path = str(tmp_path / "zero.weights.h5")
  model.save_weights(path)
  expected = dp_common.fit(model, x, y, epochs=1)["loss"]
  resumed = _model(lambda: keras.optimizers.Adam(0.01), seed=9)
  resumed.optimizer.build(resumed.trainable_variables)
  resumed.load_weights(path)
  np.testing.assert_allclose(dp_common.fit(resumed, x, y, epochs=1)["loss"],
                             expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 2}, r"supports stage=1 .* Received: stage=2"),
    ({"stage": 3}, r"supports stage=1 .* Received: stage=3"),
    ({"stage": 1, "offload": "cpu"}, r"does not support offload yet"),
])
def test_unsupported_settings_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tfpar.ZeRO(**kwargs)


def test_optimizer_created_outside_the_scope_is_refused():
  x, y = dp_common.make_data()
  optimizer = keras.optimizers.Adam(0.01)
  strategy = STRATEGIES["tfpar_data_parallel"]()
  with strategy.scope():
    model = dp_common.build_model()
    model.compile(optimizer=optimizer, loss="mse")
  with pytest.raises(ValueError, match="created outside the model's "
                     "strategy scope"):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])


def test_factored_optimizer_and_built_optimizer_are_refused():
  x, y = dp_common.make_data()
  model = _model(lambda: keras.optimizers.Adafactor(0.01),
                 STRATEGIES["tfpar_data_parallel"]())
  with pytest.raises(ValueError, match="cannot shard Adafactor"):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])
  model = _model(lambda: keras.optimizers.Adam(0.01),
                 STRATEGIES["tfpar_data_parallel"]())
  dp_common.fit(model, x, y, epochs=1)
  with pytest.raises(ValueError, match="needs optimizer .* unbuilt"):
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=1)])
