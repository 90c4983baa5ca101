"""Expert x tensor (`ExpertParallelStrategy` on data 2 x tensor 2) and
expert x pipeline (`PipelineParallelStrategy(expert=...)` on data 2 x
pipeline 2, 1F1B, 2 micro-batches) under Keras's mixed policies and its
gradient accumulation, against one device.

The model is a pre-norm stack of stock Keras layers and two `tfpar.MoE`
layers (one gated, one plain). Under the mixed policies every token goes
to every expert (top_k = num_experts): with top-2 routing a rounding
difference can move a token whose two best experts are nearly tied to
another expert, and training becomes a lottery (measured over 6 seeds:
0.08x to 73x Mirrored's weight spread for the same layout, Mirrored's
spread itself varying 21x); with every expert chosen nothing is
discontinuous, and the comparison measures rounding. The load-balancing
loss is then the same constant for any share of the batch, so stock
Mirrored (which computes it per replica) trains the same model. SGD, not
Adam, which turns rounding in near-zero gradients into steps of about
the learning rate (measured: 1.0x-6.8x the spread from seed to seed).
Gradient accumulation is exact in float32, so it is tested with top-2
routing and each micro-batch's load-balancing loss. The input gradient of
MoE layers with top-2 routing is tested on its own, bit for bit, without
training (`test_moe_input_gradient_is_one_device_s_bit_for_bit`).
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import precision_common
import suite_scope
import stock_strategies
import test_expert_pipeline_parallel
import tfpar

VOCAB, SEQUENCE, BATCH, STEPS = 32, 8, 8, 6
HIDDEN, EXPERTS, INTERMEDIATE = 16, 4, 32
DATA, MICROBATCHES = 2, 2

# Each layout is held to 2x stock Mirrored's spread (2 CPUs) against one
# device, in both policies (`precision_common.assert_within_spread`).
# Measured over 6 seeds: weights 0.46x-1.39x under mixed_float16,
# 0.62x-1.67x under mixed_bfloat16. Before tfpar.MoE's experts were batch
# matmuls and a token's expert copies were summed in expert order
# (`routing.dispatch`), one device took an MoE layer's input gradient in
# one float16 einsum, which TensorFlow's CPU kernel accumulates in float16
# (mean 8 ulps off the correctly rounded sum, not a function of the
# per-expert parts), and every float16 layout ended 1.5x-2.6x the spread
# (12 seeds). Leaving out expert 1's expert-data sum (simulated) measures
# 44x.


def moe_model(top_k=EXPERTS):
  keras.utils.set_random_seed(1)
  tokens = keras.Input((SEQUENCE,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, HIDDEN)(tokens)
  normed = keras.layers.LayerNormalization()(x)
  x = keras.layers.Add()([x, tfpar.MoE(EXPERTS, INTERMEDIATE,
                                       top_k=top_k)(normed)])
  x = keras.layers.Dense(HIDDEN, activation="gelu")(x)
  normed = keras.layers.LayerNormalization()(x)
  x = keras.layers.Add()([x, tfpar.MoE(EXPERTS, INTERMEDIATE, top_k=top_k,
                                       gated=False,
                                       activation="gelu")(normed)])
  return keras.Model(tokens, keras.layers.Dense(VOCAB)(x), name="moe_lm")


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _ids():
  ids = np.random.default_rng(0).integers(
      0, VOCAB, size=(BATCH * STEPS, SEQUENCE + 1))
  return ids.astype("int32")


def _sgd():
  return keras.optimizers.SGD(0.1, momentum=0.9)


def _adam(steps=2):
  return keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps)


def _train(strategy, optimizer, policy="float32", top_k=EXPERTS):
  """(logged step losses, get_weights()) after STEPS steps of `fit`."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope() if strategy else tf.init_scope():
      model = moe_model(top_k)
      model.compile(optimizer=optimizer(), loss=_loss())
    ids, losses = _ids(), []
    model.fit(ids[:, :-1], ids[:, 1:], batch_size=BATCH, shuffle=False,
              verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda batch, logs: losses.append(
                      logs["loss"]))])
    return np.array(losses), model.get_weights()
  finally:
    keras.mixed_precision.set_global_policy("float32")


LAYOUTS = {
    "expert 2 x tensor 2": lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": DATA, "tensor": 2}), expert=2),
    # Expert 1: the experts spread over each tensor group, their gradients
    # summed per tensor column over both replicas.
    "expert 1 x tensor 2": lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": DATA, "tensor": 2}), expert=1),
    "expert 2 x pipeline 2": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": DATA, "pipeline": 2}),
        num_microbatches=MICROBATCHES, expert=2),
    # Expert 1: each stage's experts summed over both replicas' stage
    # devices (by the inner optimizer of a LossScaleOptimizer).
    "expert 1 x pipeline 2": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": DATA, "pipeline": 2}),
        num_microbatches=MICROBATCHES, expert=1),
    # Expert groups of 2 and expert-data groups of 2 (each expert's
    # gradients summed over 2 replicas): tests/test_expert_parallel_precision.
    "expert 2 (data 4)": lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": 4}), expert=2),
}

# Which layouts run under which policy (each training costs seconds of the
# suite's budget): float16, where Keras's LossScaleOptimizer wraps the
# optimizer that sums the experts' gradients, runs the expert-data sums of
# both composed layouts (expert 1), with expert x tensor's all-to-alls and
# tensor-group exchange; bfloat16 the all-to-alls of both (expert 2).
# Expert 2 x tensor 2 under float16 with TFPAR_TEST_FULL=1 (the same
# exchange as expert 1 x tensor 2, with all-to-alls of 2).
MIXED = suite_scope.cases([("mixed_float16", "expert 1 x tensor 2"),
                           ("mixed_float16", "expert 1 x pipeline 2"),
                           ("mixed_bfloat16", "expert 2 x tensor 2"),
                           ("mixed_bfloat16", "expert 2 x pipeline 2")],
                          [("mixed_float16", "expert 2 x tensor 2")])


@functools.cache
def mixed(policy, layout=None):
  """`_train` with SGD under `policy`: one device (None), stock Mirrored
  on 2 CPUs ("mirrored") or on 4 ("mirrored 4"), or a layout of
  `LAYOUTS`."""
  if layout in ("mirrored", "mirrored 4"):
    count = 4 if layout == "mirrored 4" else DATA
    strategy = stock_strategies.mirrored(tfpar.Mesh().devices[:count])
  else:
    strategy = LAYOUTS[layout]() if layout else None
  return _train(strategy, _sgd, policy)


def difference(result, reference):
  """(losses, weights, first loss) differences, as precision_common."""
  return precision_common.differences(result[0], result[1], reference[0],
                                      reference[1])


@pytest.mark.parametrize("policy, layout", MIXED)
def test_mixed_policy_trains_like_one_device(policy, layout):
  reference = mixed(policy)
  spread = difference(mixed(policy, "mirrored"), reference)
  measured = difference(mixed(policy, layout), reference)
  print(f"\nMEASURED {policy} {layout}: losses {measured[0]:.1e} weights "
        f"{measured[1]:.1e} first loss {measured[2]:.1e}; Mirrored 2 CPUs "
        f"{spread[0]:.1e} / {spread[1]:.1e}, first loss {spread[2]:.1e}")
  precision_common.assert_within_spread(policy, False, measured, spread,
                                        reference[0][0])
  # The forward pass rounds as one device's (each expert's matmuls whole,
  # the k outputs contracted as one device contracts the experts'): the
  # first loss is no further from one device's than Mirrored's, whose
  # forward is one device's and whose logged loss differs only in its
  # float32 sums over replicas (the load-balancing term's), or two float32
  # ulps of it (before, with products rounded first or another einsum
  # layout: 7-14 ulps).
  ulp = float(np.spacing(np.float32(reference[0][0])))
  assert measured[2] <= max(spread[2], 2 * ulp), (measured, spread)


def _microbatch_loop(optimizer):
  """One device looping over the pipeline's micro-batches (micro-batch k:
  the rows of every replica's micro-batch k), each adding 1/m of its
  loss and load-balancing losses and of their gradients, then
  `optimizer.apply_gradients` once per step (Keras accumulates there)."""
  model = moe_model(top_k=2)
  optimizer, loss_fn = optimizer(), _loss()

  micro_step = test_expert_pipeline_parallel.one_device_micro_step(
      model, loss_fn, MICROBATCHES)

  rows = BATCH // DATA // MICROBATCHES
  ids, losses = _ids(), []
  for step in range(STEPS):
    batch = ids[step * BATCH:(step + 1) * BATCH]
    total, grads = 0.0, None
    for k in range(MICROBATCHES):
      index = np.concatenate([np.arange(start, start + rows) for start in
                              range(k * rows, BATCH, MICROBATCHES * rows)])
      loss, micro = micro_step(batch[index, :-1], batch[index, 1:])
      total += float(loss)
      grads = micro if grads is None else [a + b for a, b in
                                           zip(grads, micro)]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    losses.append(total)
  # What fit logs: the running mean over the epoch's steps.
  return np.cumsum(losses) / np.arange(1, STEPS + 1), model.get_weights()


# Expert 1 under expert x tensor (the expert-data sums of each tensor
# column), expert 2 under expert x pipeline (the all-to-alls of every
# micro-batch), top-2 routing with each micro-batch's load-balancing loss.
ACCUMULATING = {
    "expert 1 x tensor 2": (
        LAYOUTS["expert 1 x tensor 2"],
        lambda: _train(None, _adam, top_k=2)),
    "expert 2 x pipeline 2": (
        LAYOUTS["expert 2 x pipeline 2"],
        lambda: _microbatch_loop(_adam)),
}


@pytest.mark.parametrize("layout", sorted(ACCUMULATING))
def test_accumulation_trains_like_one_device_accumulating(layout):
  make_strategy, reference = ACCUMULATING[layout]
  want = reference()
  measured = difference(_train(make_strategy(), _adam, top_k=2), want)
  print(f"\nMEASURED {layout}, Adam k=2: losses {measured[0]:.1e} weights "
        f"{measured[1]:.1e}")
  assert measured[0] < 1e-5 and measured[1] < 1e-5, measured
  if layout == "expert 1 x tensor 2":
    # Accumulating changes training, so the comparison can fail.
    plain = difference(_train(None, lambda: _adam(None), top_k=2), want)
    print(f"MEASURED one device without accumulation: {plain[1]:.1e}")
    assert plain[1] > 1e-3, plain


def _input_gradient(strategy, tokens, upstream):
  """The gradient of sum(upstream x block output) with respect to the
  float32 input of two `tfpar.MoE` layers (gated, then plain; top-2)
  under mixed_float16: on one device (`strategy` None), or each replica's
  rows of it under `strategy` (each on its half of the tokens)."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    with strategy.scope() if strategy else tf.init_scope():
      keras.utils.set_random_seed(1)
      inputs = keras.Input((SEQUENCE, HIDDEN))
      x = keras.layers.Add()([inputs, tfpar.MoE(EXPERTS, INTERMEDIATE)(
          inputs)])
      outputs = tfpar.MoE(EXPERTS, INTERMEDIATE, gated=False,
                          activation="gelu")(x)
      model = keras.Model(inputs, outputs)

    def gradient(x, g):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.cast(model(x), tf.float32)
      return tape.gradient(y, x, output_gradients=g)

    if strategy is None:
      return tf.function(gradient)(tokens, upstream).numpy()
    halves = [tf.split(t, DATA) for t in (tokens, upstream)]
    per_replica = tf.function(lambda: strategy.run(
        lambda: gradient(*[tf.gather(tf.stack(h), tf.distribute.
                                     get_replica_context().
                                     replica_id_in_sync_group)
                           for h in halves])))()
    return np.concatenate([np.asarray(v) for v in
                           strategy.experimental_local_results(per_replica)])
  finally:
    keras.mixed_precision.set_global_policy("float32")


def test_moe_input_gradient_is_one_device_s_bit_for_bit():
  # Top-2 routing, mixed_float16, expert 2 x tensor 2 (the expert path,
  # with each tensor column running its experts; equal too on expert 2
  # over data 2 and with top-1 or top-4, measured). Each expert's part of
  # an MoE layer's input gradient is one batch matmul wherever the expert
  # is, a token's parts are added in expert order as one device adds
  # every expert's, and the routing weights' gradient is one batch matmul
  # per token on one device as in the layout (`routing.combine`). Before,
  # one device took the experts' part in one float16 einsum over all
  # experts, which TensorFlow's CPU kernel accumulates in float16, and the
  # weights' in an einsum over every expert rather than the token's k:
  # 95.6% of the elements differed (with the experts' part fixed but not
  # the weights', 67.6% on data 2).
  rng = np.random.default_rng(0)
  tokens = tf.constant(rng.standard_normal((BATCH, SEQUENCE, HIDDEN)),
                       tf.float32)
  upstream = tf.constant(rng.standard_normal((BATCH, SEQUENCE, HIDDEN)),
                         tf.float32)
  one = _input_gradient(None, tokens, upstream)
  # Expert x tensor: the expert path and each tensor column's experts (the
  # routers, the model's only other weights, stay whole).
  strategy = tfpar.ExpertParallelStrategy(
      tfpar.Mesh({"data": DATA, "tensor": 2}), expert=2,
      plan=[(".*router/kernel", tfpar.Replicate())])
  expert = _input_gradient(strategy, tokens, upstream)
  assert np.all(np.isfinite(one)) and np.abs(one).max() > 0
  np.testing.assert_array_equal(expert, one)
