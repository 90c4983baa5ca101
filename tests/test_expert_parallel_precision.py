"""Expert parallelism (data 4, experts in pairs) with Keras's gradient
accumulation, on the `tfpar.MoE` test model (tests/test_moe_layer.py,
top-2 routing with the load-balancing loss), and under Keras's mixed
policies, on tests/test_expert_layouts_precision.py's constant-loss
model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import precision_common
import test_expert_layouts_precision as layouts
import test_moe_layer


def _train(strategy, optimizer):
  """(per-step losses, weights) after test_moe_layer's 10 steps."""
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
  # Experts split in pairs over data 4 (each expert's gradients summed over
  # an expert-data group of 2), against one device and stock Mirrored over
  # the same 4 devices, on test_expert_layouts_precision's constant-loss
  # model (every token to every expert: no near-tied routing choice flips,
  # so the comparison measures rounding; SGD). Measured over 6 seeds, the
  # weights: float16 0.86x-1.18x the spread, bfloat16 0.83x-1.08x (before
  # MoE input gradients rounded as one device's, float16 1.37x-1.79x);
  # without the experts' expert-data sum (simulated) 70x and 3.0x. This
  # replaced a top-2 model whose load-balancing loss Mirrored computes
  # per replica, another loss: its spread (Adam, float16: 5.0e-2 in the
  # weights) was no test of rounding.
  reference = layouts.mixed(policy)
  spread = layouts.difference(layouts.mixed(policy, "mirrored 4"), reference)
  measured = layouts.difference(layouts.mixed(policy, "expert 2 (data 4)"),
                                reference)
  print(f"\nMEASURED {policy} expert 2 on data 4: losses {measured[0]:.1e} "
        f"weights {measured[1]:.1e} first loss {measured[2]:.1e}; Mirrored "
        f"4 CPUs {spread[0]:.1e} / {spread[1]:.1e}, first loss "
        f"{spread[2]:.1e}")
  precision_common.assert_within_spread(policy, False, measured, spread,
                                        reference[0][0])
  # The forward pass is one device's (Mirrored's logged first loss differs
  # in its float32 sums over replicas): at most two float32 ulps off.
  ulp = float(np.spacing(np.float32(reference[0][0])))
  assert measured[2] <= max(spread[2], 2 * ulp), (measured, spread)
