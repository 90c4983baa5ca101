"""How a layout's training is compared with one device (`differences`, for
every test that does), and how under a mixed policy it is held to one
device: within the spread of stock MirroredStrategy against one device
under the same policy, measured side by side (`assert_within_spread`:
test_precision_matrix, the 3D worker).

A tensor axis also changes the rounding of the forward pass itself: each
device rounds its partial sums to the compute dtype before they are summed
(as Megatron does), where one device rounds the whole product once. Stock
MirroredStrategy never does that (its first loss, the forward before any
update, is one device's to the bit), so its spread cannot show it, and how
large it is depends on the CPU's matrix kernels (native bfloat16 dot
products or not). For a tensor axis the first step's loss difference is
therefore measured on its own, bounded by a small fraction of the compute
dtype's epsilon, and carried into the bound of the later steps.
"""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

# Machine epsilon of the compute dtype: 2**-(explicit mantissa bits).
EPSILON = {"mixed_float16": 2.0**-10, "mixed_bfloat16": 2.0**-7}
# The most a tensor axis's forward rounding may move the first loss, as a
# fraction of epsilon x that loss (measured: 0.0053 in bfloat16 on an
# AVX512-BF16 CPU).
FORWARD_ROUNDING = 0.02


@contextlib.contextmanager
def global_policy(name):
  """Keras's global dtype policy `name` inside, the previous one after."""
  previous = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy(name)
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy(previous)


def differences(losses, weights, reference_losses, reference_weights):
  """(largest step-loss difference, largest weight difference, first
  step's loss difference) from one device; weights as matching lists."""
  losses, reference_losses = np.asarray(losses), np.asarray(reference_losses)
  assert len(weights) == len(reference_weights)
  return (float(np.abs(losses - reference_losses).max()),
          max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(weights, reference_weights)),
          float(abs(losses[0] - reference_losses[0])))


def assert_within_spread(policy, tensor_axis, measured, spread,
                         first_loss):
  """Asserts `measured` (from `differences`) is within the spread.

  Args:
    policy: "mixed_float16" or "mixed_bfloat16".
    tensor_axis: whether the layout splits layers over a tensor axis.
    measured: `differences(...)` of the layout against one device.
    spread: (loss, weights) of stock MirroredStrategy against one device.
    first_loss: one device's first step loss.
  """
  loss, weights, forward = measured
  spread_loss, spread_weights = spread[:2]
  # bfloat16's 8 bits of mantissa: the tensor axis's rounding of partial
  # sums moves training by up to 2.1x Mirrored's spread (the reference
  # tables in docs/precision_and_accumulation.md).
  factor = 3 if tensor_axis and policy == "mixed_bfloat16" else 2
  if tensor_axis:
    rounding = EPSILON[policy] * abs(first_loss)
    assert forward <= FORWARD_ROUNDING * rounding, (forward, rounding)
  else:
    forward = 0.0
  assert loss <= factor * spread_loss + forward + 1e-5, (
      loss, spread_loss, forward)
  assert weights <= factor * spread_weights + 1e-5, (weights,
                                                     spread_weights)


# Where a tensor axis is still outside the rule (see `fused_half_dense`).
FUSED_HALF_DENSE_GAP = (
    "this CPU's TensorFlow fuses a float16 MatMul and its bias add into one "
    "rounding (grappler's remapper on oneDNN float16 kernels: AVX512-FP16 / "
    "AMX CPUs), which tfpar's split layers do not reproduce yet; with the "
    "remapper off the layout is within the rule "
    "(docs/precision_and_accumulation.md, 'Fused float16 Dense')")


@functools.cache
def fused_half_dense():
  """Whether a traced float16 `x @ w + b` (Keras's Dense) rounds once here
  where the eager ops round twice: TensorFlow's remapper fuses them on CPUs
  with oneDNN float16 kernels (measured: 29% of the elements of a 64 x 64
  product differ; 0% with `TF_ENABLE_ONEDNN_OPTS=0`)."""
  rng = np.random.default_rng(0)
  x, w = (tf.constant(rng.normal(size=(64, 64)), tf.float16)
          for _ in range(2))
  b = tf.constant(rng.normal(size=(64,)), tf.float16)
  traced = tf.function(lambda x, w, b: tf.matmul(x, w) + b)(x, w, b)
  return not np.array_equal(traced.numpy(), (tf.matmul(x, w) + b).numpy())


@contextlib.contextmanager
def known_fused_half_dense_gap(what):
  """Runs a float16 tensor-axis check; if it fails on a CPU where
  `fused_half_dense()`, the test is reported as an expected failure naming
  the measured gap (it still fails everywhere else)."""
  try:
    yield
  except AssertionError as error:
    if fused_half_dense():
      pytest.xfail(f"{what}: {FUSED_HALF_DENSE_GAP}. Measured: {error}")
    raise
