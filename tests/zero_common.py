"""Models and strategies shared by the tfpar.ZeRO tests."""

import types

import keras
import numpy as np
import pytest
from tensorflow.python.ops import resource_variable_ops

import dp_common
import tfpar


# Every stage under a new tf.distribute.MirroredStrategy, after another
# stock strategy trained in the same process; prints per stage the
# largest loss and weight differences from one device and the last slot's
# shape. Run in a process of its own (argv[1]: the tests directory).
STOCK_MIRRORED_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import conftest, keras, numpy as np, tensorflow as tf
import dp_common, tfpar
from zero_common import model_under
make = lambda: keras.optimizers.Adam(0.01, global_clipnorm=1.0)
x, y = dp_common.make_data()
reference = model_under(make)
expected = dp_common.fit(reference, x, y)["loss"]
devices = [f"/cpu:{i}" for i in range(4)]
# A stock strategy trained earlier in the process (a notebook's first cell):
# every stock MirroredStrategy takes the same collective keys.
dp_common.fit(model_under(make, tf.distribute.MirroredStrategy(devices)), x, y)
for stage in (1, 2, 3):
  zero = model_under(make, tf.distribute.MirroredStrategy(devices))
  losses = dp_common.fit_one_iterator(zero, x, y,
                                      callbacks=[tfpar.ZeRO(stage=stage)])
  print(stage, max(abs(a - b) for a, b in zip(losses["loss"], expected)),
        max(float(np.max(np.abs(a - b))) for a, b in
            zip(zero.get_weights(), reference.get_weights())),
        tuple(zero.optimizer.variables[-1].shape))
"""


def data_parallel():
  return tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))


def model_under(make_optimizer, strategy=None, seed=1):
  def build():
    model = dp_common.build_model(seed=seed)
    model.compile(optimizer=make_optimizer(), loss="mse")
    return model
  if strategy is None:
    return build()
  with strategy.scope():
    return build()


def assert_same_training(model, reference, losses, expected):
  np.testing.assert_allclose(losses, expected, atol=1e-5, rtol=0)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _record_created_variables(monkeypatch):
  """Records (name, shape) of every tf variable created, however made."""
  created = []
  original = resource_variable_ops.ResourceVariable.__init__

  def record(self, *args, **kwargs):
    original(self, *args, **kwargs)
    created.append((self.name, tuple(self.shape)))
  monkeypatch.setattr(resource_variable_ops.ResourceVariable, "__init__",
                      record)
  return created


def adam_run(stage):
  """Adam(0.01) under data parallelism fitted one epoch with ZeRO at
  `stage` (None: no ZeRO), under a CommunicationLog: (model, log)."""
  x, y = dp_common.make_data()
  model = model_under(lambda: keras.optimizers.Adam(0.01), data_parallel())
  callbacks = [tfpar.ZeRO(stage=stage)] if stage else []
  with tfpar.CommunicationLog() as log:
    dp_common.fit(model, x, y, epochs=1, callbacks=callbacks)
  return types.SimpleNamespace(model=model, log=log)


def accumulation_run(stage):
  """Adam with gradient_accumulation_steps=2 under data parallelism fitted
  one epoch with ZeRO at `stage`: the model and the (name, shape) of every
  variable the fit created."""
  x, y = dp_common.make_data()
  model = model_under(lambda: keras.optimizers.Adam(
      0.01, gradient_accumulation_steps=2), data_parallel())
  with pytest.MonkeyPatch.context() as monkeypatch:
    created = _record_created_variables(monkeypatch)
    dp_common.fit(model, x, y, epochs=1, callbacks=[tfpar.ZeRO(stage=stage)])
  return types.SimpleNamespace(model=model, created=created)
