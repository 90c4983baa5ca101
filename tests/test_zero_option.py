"""`DataParallelStrategy(zero=tfpar.ZeRO(stage=...))`: ZeRO known before
the model is built. Every stage trains like one device and keeps 1/N of
each optimizer slot per replica. Stage 3 across workers:
test_zero_option_multi_worker.py."""

import math

import keras
import pytest

import dp_common
import tfpar
from tfpar.memory import components
from zero_common import assert_same_training
from zero_common import model_under

REPLICAS = 4


def _adam():
  return keras.optimizers.Adam(0.01, global_clipnorm=1.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_trains_like_one_device_with_slots_sliced(stage):
  x, y = dp_common.make_data()
  reference = model_under(_adam)
  expected = dp_common.fit_one_iterator(reference, x, y)["loss"]
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": REPLICAS}),
                                        zero=tfpar.ZeRO(stage=stage))
  model = model_under(_adam, strategy)
  losses = dp_common.fit_one_iterator(model, x, y)["loss"]
  assert_same_training(model, reference, losses, expected)
  # Every weight's two Adam moments (stages 1-2: also the weight's slice
  # the update writes before the all-gather), each as REPLICAS slices of
  # ceil(size / REPLICAS) elements, one per replica.
  per_weight = 2 if stage == 3 else 3
  expected_shares = sorted(
      math.ceil(w.shape.num_elements() / REPLICAS)
      for w in reference.trainable_weights for _ in range(per_weight))
  shares = []
  for slot in model.optimizer.variables:
    parts = components(slot)
    if len(parts) == REPLICAS and all(len(p.shape) == 1 for p in parts):
      assert len({p.shape.num_elements() for p in parts}) == 1, slot.path
      shares.append(parts[0].shape.num_elements())
  assert sorted(shares) == expected_shares
