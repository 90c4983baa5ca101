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
routing and each micro-batch's load-balancing loss.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import precision_common
import stock_strategies
import test_expert_pipeline_parallel
import tfpar

VOCAB, SEQUENCE, BATCH, STEPS = 32, 8, 8, 6
HIDDEN, EXPERTS, INTERMEDIATE = 16, 4, 32
DATA, MICROBATCHES = 2, 2

# How far each layout may end from one device, in multiples of stock
# Mirrored's spread (2 CPUs) against one device. Under mixed_float16 every
# expert layout, the data-only one included, ends 1.5x-2.6x that spread in
# the weights (12 seeds of this test; bfloat16: 0.7x-1.4x): the gradient
# of an MoE layer's input is summed per expert and then over the token's
# experts, where one device sums it in one einsum, and TensorFlow's float16
# einsums on CPU round as they accumulate (over 80% of the elements of an
# einsum's gradient differ from the correctly rounded sum, measured), so
# most elements move by an ulp or more; Mirrored leaves each token's
# gradients one device's bit for bit (docs/expert_parallel.md). 4x leaves
# room for other CPUs' float16 kernels; leaving out expert 1's
# expert-data sum (simulated) measures 44x.
FACTOR = {"mixed_float16": 4, "mixed_bfloat16": 2}


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


def _two_cpus():
  return tfpar.Mesh({"data": DATA}, devices=tfpar.Mesh().devices[:DATA])


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
    # The expert path alone, on 2 CPUs.
    "expert 2 (data 2)": lambda: tfpar.ExpertParallelStrategy(
        _two_cpus(), expert=2),
}

# Which layouts run under which policy (each training costs seconds of the
# suite's budget): float16, where Keras's LossScaleOptimizer wraps the
# optimizer that sums the experts' gradients, runs the expert-data sums of
# both composed layouts (expert 1) and expert x tensor's all-to-alls;
# bfloat16 the all-to-alls of both (expert 2).
MIXED = [("mixed_float16", "expert 2 x tensor 2"),
         ("mixed_float16", "expert 1 x tensor 2"),
         ("mixed_float16", "expert 1 x pipeline 2"),
         ("mixed_bfloat16", "expert 2 x tensor 2"),
         ("mixed_bfloat16", "expert 2 x pipeline 2")]


@functools.cache
def _mixed(policy, layout=None):
  """`_train` with SGD under `policy`: one device (None), stock Mirrored
  on 2 CPUs ("mirrored") or a layout."""
  if layout == "mirrored":
    strategy = stock_strategies.mirrored(tfpar.Mesh().devices[:DATA])
  else:
    strategy = LAYOUTS[layout]() if layout else None
  return _train(strategy, _sgd, policy)


def _difference(result, reference):
  """(losses, weights, first loss) differences, as precision_common."""
  return precision_common.differences(result[0], result[1], reference[0],
                                      reference[1])


@pytest.mark.parametrize("policy, layout", MIXED)
def test_mixed_policy_trains_like_one_device(policy, layout):
  reference = _mixed(policy)
  spread = _difference(_mixed(policy, "mirrored"), reference)
  measured = _difference(_mixed(policy, layout), reference)
  print(f"\nMEASURED {policy} {layout}: losses {measured[0]:.1e} weights "
        f"{measured[1]:.1e} first loss {measured[2]:.1e}; Mirrored 2 CPUs "
        f"{spread[0]:.1e} / {spread[1]:.1e}, first loss {spread[2]:.1e}")
  factor = FACTOR[policy]
  assert measured[0] <= factor * spread[0] + 1e-5, (measured, spread)
  assert measured[1] <= factor * spread[1] + 1e-5, (measured, spread)
  # The forward pass rounds as one device's (each expert's matmuls whole,
  # the k outputs contracted as one device contracts the experts'): the
  # first loss is no further from one device's than Mirrored's, whose
  # forward is one device's and whose logged loss differs only in its
  # float32 sums over replicas (the load-balancing term's), or two float32
  # ulps of it (before, with products rounded first or another einsum
  # layout: 7-14 ulps).
  ulp = float(np.spacing(np.float32(reference[0][0])))
  assert measured[2] <= max(spread[2], 2 * ulp), (measured, spread)


def test_expert_x_tensor_rounds_as_the_expert_path_alone():
  # What expert x tensor differs from one device by under float16 is the
  # expert path's (the data-only layout's on 2 CPUs): measured equal to
  # the last bit on this model, allowed Mirrored's spread.
  policy = "mixed_float16"
  reference = _mixed(policy)
  spread = _difference(_mixed(policy, "mirrored"), reference)
  alone = _mixed(policy, "expert 2 (data 2)")
  between = _difference(_mixed(policy, "expert 2 x tensor 2"), alone)
  measured = _difference(alone, reference)
  print(f"\nMEASURED {policy} expert 2 on data 2: losses {measured[0]:.1e} "
        f"weights {measured[1]:.1e}; expert 2 x tensor 2 from it "
        f"{between[0]:.1e} / {between[1]:.1e}; Mirrored {spread[0]:.1e} / "
        f"{spread[1]:.1e}")
  assert between[0] <= spread[0] and between[1] <= spread[1], between
  assert measured[1] <= FACTOR[policy] * spread[1] + 1e-5, measured


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
  measured = _difference(_train(make_strategy(), _adam, top_k=2), want)
  print(f"\nMEASURED {layout}, Adam k=2: losses {measured[0]:.1e} weights "
        f"{measured[1]:.1e}")
  assert measured[0] < 1e-5 and measured[1] < 1e-5, measured
  if layout == "expert 1 x tensor 2":
    # Accumulating changes training, so the comparison can fail.
    plain = _difference(_train(None, lambda: _adam(None), top_k=2), want)
    print(f"MEASURED one device without accumulation: {plain[1]:.1e}")
    assert plain[1] > 1e-3, plain
