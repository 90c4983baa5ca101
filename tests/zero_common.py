"""Models, optimizers and strategies shared by the tfpar.ZeRO tests."""

import keras
import numpy as np
from tensorflow.python.ops import resource_variable_ops

import dp_common
import tfpar

OPTIMIZERS = {
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(
        0.05, momentum=0.9, clipnorm=0.5),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=1.0),
    "adamw_weight_decay": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1),
    "rmsprop_clipvalue": lambda: keras.optimizers.RMSprop(
        0.005, momentum=0.5, clipvalue=0.1),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "lion": lambda: keras.optimizers.Lion(0.003),
    "adam_accumulation_clipnorm": lambda: keras.optimizers.Adam(
        0.01, clipnorm=0.5, gradient_accumulation_steps=2),
}

# Every stage under a new tf.distribute.MirroredStrategy, after another
# stock strategy trained in the same process; prints per stage a JSON line
# of the epoch losses, the weights and the last slot's shape. Run in a
# process of its own (argv[1]: the tests directory).
STOCK_MIRRORED_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import conftest, tensorflow as tf
import dp_common, tfpar
from zero_common import model_under, OPTIMIZERS
make = OPTIMIZERS["adam_global_clipnorm"]
x, y = dp_common.make_data()
devices = [f"/cpu:{i}" for i in range(4)]
# A stock strategy trained earlier in the process (a notebook's first cell):
# every stock MirroredStrategy takes the same collective keys.
dp_common.fit(model_under(make, tf.distribute.MirroredStrategy(devices)), x, y)
for stage in (1, 2, 3):
  zero = model_under(make, tf.distribute.MirroredStrategy(devices))
  losses = dp_common.fit_one_iterator(zero, x, y,
                                      callbacks=[tfpar.ZeRO(stage=stage)])
  print(json.dumps({"stage": stage, "losses": losses["loss"],
                    "weights": [w.tolist() for w in zero.get_weights()],
                    "slot_shape": list(zero.optimizer.variables[-1].shape)}))
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


def record_created_variables(monkeypatch):
  """Records (name, shape) of every tf variable created, however made."""
  created = []
  original = resource_variable_ops.ResourceVariable.__init__

  def record(self, *args, **kwargs):
    original(self, *args, **kwargs)
    created.append((self.name, tuple(self.shape)))
  monkeypatch.setattr(resource_variable_ops.ResourceVariable, "__init__",
                      record)
  return created
