"""keras-hub Llama under `mixed_bfloat16` and `mixed_float16` on data 2 x
tensor 2 and (bfloat16) tensor 4 (the default float32 partial sums),
against one device under the same policy and stock Mirrored on 2 CPUs side
by side.

One step's gradients are compared weight by weight: tensor parallelism
rounds as one device does, so in bfloat16 its gradients are stock
Mirrored's (same batch halves) but for rare last-bit flips of float32
sums added in another order. Before tfpar rounded each attention
projection's input gradient on its own and took the attention kernels'
gradients as one device does (a compute-dtype product per batch row),
every weight below the last attention block differed from Mirrored's in
35-90% of its elements (3e-3 to 6e-3 of the gradient).

Tensor 4 shares each of Llama's 2 key/value heads between 2 devices:
before tfpar computed each head once and handed it to the device sharing
it (`tensor_parallel/shared_heads.py`), both devices computed it and their
kernel gradients were added in float32, while one device adds the repeated
heads' gradients in bfloat16 and takes one kernel gradient: 13 of 21
weights' gradients differed from one device's (81-92% of the key/value
kernels' elements), and 10 steps ended 1.8-7.3x Mirrored's loss spread
(seeds 1-3).

Qwen2's query/key/value biases are added with the op Keras takes for the
whole bias (`rounding.add_bias`): one head's slice of a [heads, head_dim]
bias would otherwise be a BiasAdd, whose bfloat16 gradient accumulates in
bfloat16, where one device's AddV2 sums in float32.

The one-step bounds were first met by the retired replica-head design;
before SPMD gave each split projection its own float32 copy of
its input, summed a shared key/value head's gradients on one device
(after its rotary embedding) and took the untied output table's logits
in float32 as Keras's Embedding does, its Llama gradients were 2.5x
Mirrored's distance from one device (bfloat16, data 2 x tensor 2) and its
first loss was not one device's; then its gradients were the head
design's bit for bit (Qwen2 included)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import stock_strategies
import suite_scope
import tfpar


class GradientWriter(keras.optimizers.SGD):
  """Writes each (all-reduced, unscaled) gradient into its variable."""

  def update_step(self, gradient, variable, learning_rate):
    del learning_rate
    if isinstance(gradient, tf.IndexedSlices):
      gradient = tf.convert_to_tensor(gradient)
    variable.assign(tf.cast(gradient, variable.dtype))


def _strategy(layout):
  if layout is None:
    return None
  if layout == "mirrored2":
    return stock_strategies.mirrored(tfpar.Mesh().devices[:2])
  return tfpar.TensorParallelStrategy(tfpar.Mesh(
      {"data2_tensor2": {"data": 2, "tensor": 2},
       "tensor4": {"data": 1, "tensor": 4}}[layout]))


@functools.lru_cache(maxsize=None)
def _one_step(policy, layout=None, family="llama", seed=1):
  """(first loss, [gradient of every weight, whole, in model.weights order],
  the step's CommunicationLog) on one device (`layout` None) or a layout."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    strategy = _strategy(layout)
    with strategy.scope() if strategy else tf.init_scope():
      model = hub_common.language_model(family, seed=seed)
      model.compile(optimizer=GradientWriter(1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
    x, y = hub_common.data(family, count=hub_common.BATCH)
    with tfpar.CommunicationLog() as log:
      history = model.fit(x, y, batch_size=hub_common.BATCH, verbose=0)
    return history.history["loss"][0], [
        np.asarray(w, np.float64) for w in model.get_weights()], log
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _relative(a, b, scale):
  return np.linalg.norm(a - b) / max(np.linalg.norm(scale), 1e-30)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_one_step_gradients_round_as_one_device(policy):
  one = _one_step(policy)
  mirrored = _one_step(policy, "mirrored2")
  tensor = _one_step(policy, "data2_tensor2")
  assert tensor[0] == one[0]  # The forward rounds as one device's.
  for t, m, o in zip(tensor[1], mirrored[1], one[1]):
    if policy == "mixed_bfloat16":
      # Measured (seeds 1-3): equal to Mirrored's but for at most 2.5% of
      # one weight's elements, 6.7e-4 of its gradient.
      assert np.mean(t != m) <= 0.1
      assert _relative(t, m, o) <= 1.5e-3
    else:
      # float16 (Eigen's kernels on this CPU): TP's error from one device
      # at most 2.1e-4 above Mirrored's on any weight (seeds 1-3).
      assert _relative(t, o, o) <= _relative(m, o, o) + 5e-4


def test_shared_key_value_heads_round_as_one_device():
  # Tensor 4, one replica: its gradients are one device's (the same batch).
  one = _one_step("mixed_bfloat16")
  tensor = _one_step("mixed_bfloat16", "tensor4")
  assert tensor[0] == one[0]
  for t, o in zip(tensor[1], one[1]):
    # Measured (seeds 1-3): at most 3.1% of a weight's elements, 6.1e-4 of
    # its gradient, seeds 2 and 3 bit for bit (before: 81-92% of the
    # key/value kernels' elements, up to 7.2e-3).
    assert np.mean(t != o) <= 0.1
    assert _relative(t, o, o) <= 1.5e-3


def test_head_biases_round_as_one_device():
  # Qwen2's query/key/value biases are [heads, head_dim]: one device's
  # `ops.add` is an AddV2, whose bias gradient is a Sum accumulating in
  # float32. One head's slice (tensor 4) squeezes to a vector, for which
  # Keras takes BiasAdd, whose bfloat16 gradient accumulates in bfloat16:
  # before tfpar added each slice by the whole bias's op
  # (`rounding.add_bias`), the six bias gradients differed from one
  # device's in 69-100% of their elements. Seed 2: bit for bit now (seed
  # 1: last-bit flips of the layer-0 gradients, from float32 sums added in
  # another order, which the near-cancelling bias sums amplify).
  one = _one_step("mixed_bfloat16", family="qwen2", seed=2)
  tensor = _one_step("mixed_bfloat16", "tensor4", family="qwen2", seed=2)
  assert tensor[0] == one[0]
  for t, o in zip(tensor[1], one[1]):
    assert np.mean(t != o) <= 0.1
    assert _relative(t, o, o) <= 1.5e-3


def test_attention_input_gradient_takes_one_reduction_per_projection():
  # Under a mixed policy each split projection's input gradient is
  # all-reduced over the tensor group in float32, one per projection and
  # device (3 per attention layer: query, key, value); the layer's plain
  # copy of the input adds none.
  log = _one_step("mixed_bfloat16", "data2_tensor2")[2]
  backward = [r for r in log.step_records(0)
              if r.kind == "all-reduce" and r.phase == "backward"]
  attention = [r for r in backward if r.layer in ("query", "key", "value")]
  assert len(attention) == 3 * 2 * 2  # Two blocks, two devices.
  assert all(r.bytes == attention[0].bytes for r in attention)
  assert {r.layer for r in backward} == {
      "query", "key", "value", "feedforward_gate_dense",
      "feedforward_intermediate_dense", "token_embedding"}


@functools.lru_cache(maxsize=None)
def _ten_steps(policy, layout=None):
  """(step losses, weights) after hub_common.STEPS steps of Adam."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    model, losses = hub_common.train("llama", "adam", _strategy(layout))
    return losses, model.get_weights()
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _differences(run, reference):
  return (float(np.abs(run[0] - reference[0]).max()),
          max(float(np.abs(a - b).max()) for a, b in zip(run[1], reference[1])))


# Tensor 4 with TFPAR_TEST_FULL=1: the one-step tests above run its shared
# key/value heads under both policies.
@pytest.mark.parametrize("layout", suite_scope.cases(["data2_tensor2"],
                                                     ["tensor4"]))
def test_ten_steps_in_bfloat16_within_twice_mirrored_spread(layout):
  # Measured (seeds 1-3, losses / weights, TP over Mirrored 2): bfloat16
  # data 2 x tensor 2 0.93-1.17x / 1.0-1.05x (before: 1.2-4.1x /
  # 1.1-1.9x), tensor 4 0.01-0.69x / 0.04-0.14x (before: 1.8-7.3x /
  # 0.71-1.8x); float16, left out for time
  # (inside before too): 0.28-1.09x / 0.69-1.47x.
  policy = "mixed_bfloat16"
  one = _ten_steps(policy)
  spread = _differences(_ten_steps(policy, "mirrored2"), one)
  tensor = _differences(_ten_steps(policy, layout), one)
  assert tensor[0] <= 2 * spread[0] and tensor[1] <= 2 * spread[1], (
      tensor, spread)
