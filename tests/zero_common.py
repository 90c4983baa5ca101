"""Models and strategies shared by the tfpar.ZeRO tests."""

import numpy as np

import dp_common
import tfpar


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
