"""Expert parallelism with Keras's gradient accumulation and mixed
policies, on the `tfpar.MoE` test model (tests/test_moe_layer.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import stock_strategies
import test_moe_layer
import tfpar


def _train(strategy, optimizer, policy="float32"):
  """(per-step losses, weights) after test_moe_layer's 10 steps."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    scope = strategy.scope() if strategy else tf.distribute.get_strategy(
        ).scope()
    with scope:
      model = test_moe_layer.moe_model()
      model.compile(optimizer=optimizer(), loss=keras.losses.
                    SparseCategoricalCrossentropy(from_logits=True))
    ids = test_moe_layer.token_ids()
    losses = []
    model.fit(ids[:, :-1], ids[:, 1:], batch_size=test_moe_layer.BATCH,
              shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda batch, logs: losses.append(
                      logs["loss"]))])
    return np.array(losses), model.get_weights()
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _differences(got, want):
  """(largest loss difference, largest weight difference)."""
  assert len(got[1]) == len(want[1])
  return (float(np.abs(got[0] - want[0]).max()),
          max(float(np.abs(a - b).max()) for a, b in zip(got[1], want[1])))


def test_accumulation_trains_like_one_device_accumulating():
  adam = lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
  reference = _train(None, adam)
  losses, weights = _differences(
      _train(test_moe_layer.expert_parallel(2), adam), reference)
  print(f"expert 2, k=2: losses {losses:.1e}, weights {weights:.1e}")
  assert losses < 1e-5 and weights < 1e-4  # Adam (see test_moe_layer).
  # Accumulation changes training, so the comparison can fail.
  plain = _differences(_train(None, lambda: keras.optimizers.Adam(0.01)),
                       reference)
  assert plain[1] > 1e-3, plain


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_policies_within_the_mirrored_spread(policy):
  # The spread is stock Mirrored over the same 4 devices as the layout
  # (data 4, expert 2): each replica's share of the batch, as here. Adam:
  # the experts' gradients are small, so with SGD their updates would
  # hardly show (under mixed_float16 they once went wrong unnoticed).
  adam = lambda: keras.optimizers.Adam(0.01)
  reference = _train(None, adam, policy)
  mirrored = _differences(
      _train(stock_strategies.mirrored(tfpar.Mesh().devices[:4]), adam,
             policy), reference)
  expert = _differences(
      _train(test_moe_layer.expert_parallel(2), adam, policy), reference)
  print(f"{policy}: Mirrored spread {mirrored}, expert 2 {expert}")
  assert expert[0] <= max(2 * mirrored[0], 1e-6), (expert, mirrored)
  assert expert[1] <= 2 * mirrored[1], (expert, mirrored)
