"""tfpar.ZeRO(stage=3) gathers weights, and reduce-scatters their
gradients, in buckets of up to `bucket_bytes`: the collectives per step
follow the bucket size (one per weight with tiny buckets, as before
buckets), the bytes per device do not change, and training stays equal to
one device.

The collectives are counted at run time by `collective_count`, which wraps
TensorFlow's own `all_gather_v2` / `all_to_all_v2` (ZeRO's reduce-scatter
is an all-to-all on CPU): not by tfpar's bookkeeping.
"""

import math

import keras
import numpy as np
import pytest

import collective_count
import dp_common
import tfpar
from zero_common import assert_same_training
from zero_common import data_parallel
from zero_common import model_under

REPLICAS = 4
# The test MLP: Dense 8->32, 32->16, 16->1 (kernel, bias each).
WEIGHTS = [(8, 32), (32,), (32, 16), (16,), (16, 1), (1,)]
LAYER_BYTES = [4 * (8 * 32 + 32), 4 * (32 * 16 + 16), 4 * (16 + 1)]
TOTAL_BYTES = sum(LAYER_BYTES)  # 3,332 (833 float32 parameters)


def _adamw():  # No clipping: no all-reduce of norms.
  return keras.optimizers.AdamW(0.01, weight_decay=0.1)


def _counted_fit(bucket_bytes, x, y):
  """The model, epoch losses, and collectives and input bytes per step
  and device of a fit of ZeRO-3 with `bucket_bytes` (every step runs the
  same collectives)."""
  model = model_under(_adamw, data_parallel())
  with collective_count.gathers_and_all_to_alls() as counted:
    losses = dp_common.fit(model, x, y, epochs=1, callbacks=[
        tfpar.ZeRO(stage=3, bucket_bytes=bucket_bytes)])["loss"]
  per = dp_common.STEPS_PER_EPOCH * REPLICAS
  return model, losses, {key: value / per for key, value in counted.items()}


@pytest.fixture(scope="module")
def runs():
  """name -> (model, losses, counts) of ZeRO-3 with tiny buckets (one
  weight each), buckets of the largest layer and of the whole model; and
  "one device" -> (model, losses)."""
  x, y = dp_common.make_data()
  reference = model_under(_adamw)
  result = {"one device": (reference, dp_common.fit(reference, x, y,
                                                    epochs=1)["loss"])}
  for name, size in (("tiny", 1), ("per_layer", max(LAYER_BYTES)),
                     ("whole", TOTAL_BYTES)):
    result[name] = _counted_fit(size, x, y)
  return result


@pytest.fixture(scope="module")
def counts(runs):
  return {name: run[2] for name, run in runs.items() if len(run) == 3}


def test_collectives_per_step_follow_the_bucket_size(counts):
  weights = len(WEIGHTS)
  # Each bucket: an all-gather in the forward pass and one in the
  # recomputed backward pass, and one reduce-scatter of its gradients.
  # Tiny buckets: one per weight, the count before buckets existed.
  assert counts["tiny"]["all-gather"] == 2 * weights
  assert counts["tiny"]["all-to-all"] == weights
  # Buckets of the largest layer's bytes: the model does not fit in one,
  # each layer does (3 buckets, ceil(3,332 / 2,112) = 2 at best).
  assert counts["per_layer"]["all-gather"] == 2 * len(LAYER_BYTES)
  assert counts["per_layer"]["all-to-all"] == len(LAYER_BYTES)
  # Buckets of the whole model's bytes: one bucket.
  assert counts["whole"]["all-gather"] == 2
  assert counts["whole"]["all-to-all"] == 1
  for name, size in (("tiny", 1), ("per_layer", max(LAYER_BYTES)),
                     ("whole", TOTAL_BYTES)):
    buckets = counts[name]["all-to-all"]
    assert math.ceil(TOTAL_BYTES / size) <= buckets or buckets == weights
    assert buckets <= min(weights, 2 * math.ceil(TOTAL_BYTES / size))


@pytest.mark.parametrize("name", ["tiny", "per_layer", "whole"])
def test_every_bucket_size_trains_like_one_device(runs, name):
  reference, expected = runs["one device"]
  model, losses, _ = runs[name]
  assert_same_training(model, reference, losses, expected)


def test_bytes_per_device_do_not_depend_on_buckets(counts):
  # ZeRO's count: each device sends its slice of every weight (padded to
  # a multiple of 4 replicas) in each all-gather, and its gradient (4
  # slices) in each reduce-scatter.
  sliced = sum(math.ceil(math.prod(shape) / REPLICAS) for shape in WEIGHTS)
  for count in counts.values():
    assert count["all-gather bytes"] == 2 * 4 * sliced
    assert count["all-to-all bytes"] == REPLICAS * 4 * sliced


class _SeededDense(keras.layers.Dense):
  """A Dense layer that owns a seed generator (as a layer with dropout
  inside does), so ZeRO keeps its gathered weights instead of recomputing
  it; it draws no numbers, so one device gives the same results."""

  def __init__(self, units, **kwargs):
    super().__init__(units, **kwargs)
    self.seed_generator = keras.random.SeedGenerator(1)


def _block_model(seed=3):
  """Dense, then a nested block (a Sequential: Dense + LayerNormalization),
  then a Dense layer that owns a seed generator (not recomputed)."""
  inputs = keras.Input((dp_common.FEATURES,))
  hidden = keras.layers.Dense(16, activation="tanh")(inputs)
  block = keras.Sequential([keras.layers.Dense(16, activation="relu"),
                            keras.layers.LayerNormalization()])
  outputs = _SeededDense(1)(block(hidden))
  model = keras.Model(inputs, outputs)
  rng = np.random.default_rng(seed)
  model.set_weights([0.3 * rng.normal(size=w.shape).astype("float32")
                     for w in model.get_weights()])
  model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=0.5),
                loss="mse")
  return model


def test_nested_blocks_and_seeded_layers_train_like_one_device():
  x, y = dp_common.make_data()
  reference = _block_model()
  expected = dp_common.fit_one_iterator(reference, x, y)["loss"]
  with data_parallel().scope():
    model = _block_model()
  losses = dp_common.fit_one_iterator(
      model, x, y, callbacks=[tfpar.ZeRO(stage=3, bucket_bytes=2_000)])[
          "loss"]
  assert_same_training(model, reference, losses, expected)
  assert len(losses) == dp_common.EPOCHS
  np.testing.assert_array_less(losses[-1], losses[0])
