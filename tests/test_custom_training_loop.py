"""Custom training loops (TensorFlow's guide, `strategy.run` with
`optimizer.apply_gradients`) under tfpar's strategies, against the same
loop on one device.

The guide's code as written ("Custom training with tf.distribute.Strategy":
`experimental_distribute_dataset`, `tf.nn.compute_average_loss`,
`strategy.reduce`), with Keras 3's optimizer and global-norm clipping.
"""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import precision_common
import stock_strategies
import tfpar

GLOBAL_BATCH_SIZE = 16
EPOCHS = 2


def _dataset():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(128, 12)).astype("float32")
  y = rng.integers(0, 5, size=(128,)).astype("int64")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)


def _create_model():
  keras.utils.set_random_seed(7)
  return keras.Sequential([
      keras.Input((12,)), keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(64, activation="relu"), keras.layers.Dense(5)])


def _train(strategy, build_first=False, policy=None, clipnorm=0.5,
           step_losses=None):
  """The guide's loop; (epoch losses, weights, optimizer).

  Under `policy` "mixed_float16" the loss is scaled as Keras's guide does
  (`LossScaleOptimizer.scale_loss`); `step_losses`, a list, gets each
  step's loss.
  """
  with precision_common.global_policy(policy or "float32"):
    return _train_in_policy(strategy, build_first, policy, clipnorm,
                            step_losses)


def _train_in_policy(strategy, build_first, policy, clipnorm, step_losses):
  with strategy.scope():
    model = _create_model()
    optimizer = keras.optimizers.Adam(global_clipnorm=clipnorm)
    if policy == "mixed_float16":
      optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    if build_first:
      optimizer.build(model.trainable_variables)
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    def compute_loss(labels, predictions):
      per_example_loss = loss_object(labels, predictions)
      return tf.nn.compute_average_loss(per_example_loss,
                                        global_batch_size=GLOBAL_BATCH_SIZE)

  def train_step(inputs):
    images, labels = inputs
    with tf.GradientTape() as tape:
      predictions = model(images, training=True)
      loss = compute_loss(labels, predictions)
      scaled_loss = (optimizer.scale_loss(loss)
                     if policy == "mixed_float16" else loss)
    gradients = tape.gradient(scaled_loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss

  @tf.function
  def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses,
                           axis=None)

  losses = []
  for _ in range(EPOCHS):
    total, batches = 0.0, 0
    for batch in strategy.experimental_distribute_dataset(_dataset()):
      loss = float(distributed_train_step(batch))
      total += loss
      batches += 1
      if step_losses is not None:
        step_losses.append(loss)
    losses.append(total / batches)
  return losses, [np.asarray(w) for w in model.get_weights()], optimizer


@functools.lru_cache(maxsize=None)
def _one_device():
  losses, weights, optimizer = _train(tf.distribute.get_strategy())
  return losses, weights, _state_bytes_per_device(optimizer)


def _state_bytes_per_device(optimizer):
  """{device: bytes} of the optimizer's moments."""
  return _bytes_per_device(
      optimizer.variables, lambda path: path.endswith(("momentum",
                                                       "velocity")))


def _bytes_per_device(variables, counted):
  """{device: bytes} of the `variables` whose paths are `counted`, from
  each variable's components (an independent count, not tfpar's report)."""
  held = {}
  for variable in variables:
    if not counted(variable.path):
      continue
    inner = getattr(variable, "value", variable)
    for component in getattr(inner, "values", (inner,)):
      held[component.device] = held.get(component.device, 0) + (
          component.shape.num_elements() * component.dtype.size)
  return held


# (strategy, build the optimizer before the loop, (low, high): the share
# of the one-device moments' bytes each device holds, padding aside).
LAYOUTS = {
    "data 4": (lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 4})), False, (1, 1)),
    # Split kernels' moments halved, replicated biases' whole.
    "data 2 x tensor 2": (lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})), False, (0.5, 0.99)),
    # The same, then halved again over the 2 data replicas.
    "data 2 x tensor 2, ZeRO-2": (lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2}), zero=tfpar.ZeRO(stage=2)),
                                  True, (0.25, 0.5)),
    "data 4, ZeRO-1": (lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 4}), zero=tfpar.ZeRO(stage=1)), True, (0.25,
                                                                  0.25)),
    "data 4, ZeRO-2": (lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 4}), zero=tfpar.ZeRO(stage=2)), True, (0.25,
                                                                  0.25)),
    "data 4, ZeRO-3": (lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 4}), zero=tfpar.ZeRO(stage=3)), True, (0.25,
                                                                  0.25)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_guides_loop_trains_as_one_device(layout):
  make, build_first, (low, high) = LAYOUTS[layout]
  reference_losses, reference_weights, reference_bytes = _one_device()
  losses, weights, optimizer = _train(make(), build_first)
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-6)
  for got, want in zip(weights, reference_weights):
    np.testing.assert_allclose(got, want, atol=1e-6)
  whole = sum(reference_bytes.values())
  held = _state_bytes_per_device(optimizer)
  assert len(held) == 4
  for device_bytes in held.values():  # Slices are padded to whole rows.
    assert low * whole <= device_bytes <= high * whole + 64, (held, whole)


def test_clipping_is_by_the_global_norm_of_the_summed_gradients():
  # Clipping each replica's gradient (stock MirroredStrategy's order)
  # trains another model: the test above would fail on it.
  reference_losses, reference_weights, _ = _one_device()
  losses, weights, _ = _train_unclipped_replicas()
  assert not np.allclose(losses, reference_losses, rtol=1e-6) or not all(
      np.allclose(a, b, atol=1e-6) for a, b in zip(weights,
                                                   reference_weights))


def _train_unclipped_replicas():
  """One device, each of 4 quarter-batches clipped on its own first."""
  model = _create_model()
  optimizer = keras.optimizers.Adam()
  loss_object = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)

  @tf.function
  def step(x, y):
    total_loss, total = 0.0, None
    for part in range(4):
      rows = slice(part * 4, part * 4 + 4)
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loss_object(y[rows], model(x[rows]))) / 16
      grads, _ = tf.clip_by_global_norm(
          tape.gradient(loss, model.trainable_variables), 0.5)
      total = grads if total is None else [a + b for a, b in zip(total,
                                                                 grads)]
      total_loss += loss
    optimizer.apply_gradients(zip(total, model.trainable_variables))
    return total_loss

  losses = []
  for _ in range(EPOCHS):
    values = [float(step(x, y)) for x, y in _dataset()]
    losses.append(sum(values) / len(values))
  return losses, [np.asarray(w) for w in model.get_weights()], optimizer


def test_zero_needs_the_optimizer_built_before_the_loop():
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}),
                                        zero=tfpar.ZeRO(stage=1))
  with pytest.raises(ValueError) as raised:
    _train(strategy, build_first=False)
  message = str(raised.value)
  assert "zero=tfpar.ZeRO(stage=1)" in message
  assert "optimizer.build(model.trainable_variables)" in message


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_refuses_eager_replica_functions(stage):
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}),
                                        zero=tfpar.ZeRO(stage=stage))
  with strategy.scope():
    model = _create_model()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)

  def train_step(inputs):
    x, y = inputs
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          y, model(x), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  batch = next(iter(strategy.experimental_distribute_dataset(_dataset())))
  before = [np.asarray(w) for w in model.get_weights()]
  with pytest.raises(ValueError, match=f"tfpar.ZeRO\\(stage={stage}\\) .* "
                     "run eagerly cannot.* tf.function"):
    strategy.run(train_step, args=(batch,))  # No tf.function: eager.
  for got, want in zip(model.get_weights(), before):
    np.testing.assert_array_equal(got, want)


# Under a mixed policy, held to stock MirroredStrategy's spread on as many
# data replicas (precision_common's rule). Without clipping: stock
# Mirrored clips each replica's gradient, another model than one device's.
# Stock Mirrored also needs the optimizer built before the loop (left to
# the first `apply_gradients` it fails inside TensorFlow under Keras 3).
MIXED_LAYOUTS = {
    "data 4": (lambda: tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4})),
               4, False),
    "data 2 x tensor 2, ZeRO-2": (lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2}), zero=tfpar.ZeRO(stage=2)),
                                  2, True),
}


@functools.lru_cache(maxsize=None)
def _mixed_reference(policy, replicas):
  """(step losses, weights) on one device (replicas 1) or stock Mirrored."""
  strategy = (tf.distribute.get_strategy() if replicas == 1 else
              stock_strategies.mirrored(tfpar.Mesh().devices[:replicas]))
  step_losses = []
  _, weights, _ = _train(strategy, replicas > 1, policy, None, step_losses)
  return step_losses, weights


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("layout", list(MIXED_LAYOUTS))
def test_the_guides_loop_under_a_mixed_policy_is_within_the_spread(
    policy, layout):
  make, replicas, tensor_axis = MIXED_LAYOUTS[layout]
  reference = _mixed_reference(policy, 1)
  spread = precision_common.differences(*_mixed_reference(policy, replicas),
                                        *reference)
  step_losses = []
  _, weights, _ = _train(make(), True, policy, None, step_losses)
  measured = precision_common.differences(step_losses, weights, *reference)
  check = (precision_common.known_fused_half_dense_gap(layout)
           if tensor_axis and policy == "mixed_float16" else
           contextlib.nullcontext())
  with check:
    precision_common.assert_within_spread(policy, tensor_axis, measured,
                                          spread, reference[0][0])


def _small_moe_model():
  keras.utils.set_random_seed(1)
  tokens = keras.Input((8,), dtype="int32")
  x = keras.layers.Embedding(32, 16)(tokens)
  x = keras.layers.Add()([x, tfpar.MoE(4, 32, top_k=2)(x)])
  return keras.Model(tokens, keras.layers.Dense(32)(x))


def _moe_dataset():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, size=(64, 8)).astype("int32")
  targets = rng.integers(0, 32, size=(64, 8)).astype("int64")
  return tf.data.Dataset.from_tensor_slices((tokens, targets)).batch(
      GLOBAL_BATCH_SIZE)


def _train_moe(strategy, clipnorm):
  """The guide's loop on `_small_moe_model`, the optimizer built before
  it; (step losses, weights, model, optimizer)."""
  with strategy.scope():
    model = _small_moe_model()
    optimizer = keras.optimizers.Adam(global_clipnorm=clipnorm)
    optimizer.build(model.trainable_variables)
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

  def train_step(inputs):
    tokens, targets = inputs
    with tf.GradientTape() as tape:
      per_example = tf.reduce_mean(
          loss_object(targets, model(tokens, training=True)), axis=-1)
      loss = tf.nn.compute_average_loss(per_example,
                                        global_batch_size=GLOBAL_BATCH_SIZE)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss

  @tf.function
  def distributed_train_step(dataset_inputs):
    return strategy.reduce(tf.distribute.ReduceOp.SUM,
                           strategy.run(train_step, args=(dataset_inputs,)),
                           axis=None)

  losses = [float(distributed_train_step(batch)) for _ in range(EPOCHS)
            for batch in strategy.experimental_distribute_dataset(
                _moe_dataset())]
  return losses, [np.asarray(w) for w in model.get_weights()], model, optimizer


# (strategy, global_clipnorm, devices sharing each expert group's experts).
EXPERT_LAYOUTS = {
    "data 4, expert 2": (lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": 4}), expert=2), 0.5, 2),
    # Clipping by norm under expert x tensor is refused (below).
    "data 2 x tensor 2, expert 2": (lambda: tfpar.ExpertParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2}), expert=2), None, 4),
}


@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_the_guides_loop_under_expert_parallelism_trains_as_one_device(
    layout):
  make, clipnorm, sharing = EXPERT_LAYOUTS[layout]
  reference = _train_moe(tf.distribute.get_strategy(), clipnorm)
  losses, weights, model, optimizer = _train_moe(make(), clipnorm)
  np.testing.assert_allclose(losses, reference[0], rtol=1e-6)
  for got, want in zip(weights, reference[1]):
    np.testing.assert_allclose(got, want, atol=1e-6)
  # Each device holds 1/sharing of the experts and of their moments.
  for pick, suffixes in (
      (lambda model, _: model.trainable_variables, ("kernel",
                                                    "kernel_experts")),
      (lambda _, optimizer: optimizer.variables, ("momentum", "velocity"))):
    def counted(path, suffixes=suffixes):
      return "experts" in path and path.endswith(suffixes)

    whole = sum(_bytes_per_device(pick(*reference[2:]), counted).values())
    held = _bytes_per_device(pick(model, optimizer), counted)
    assert whole > 0 and len(held) == 4, (held, whole)
    assert all(b == whole // sharing for b in held.values()), (held, whole)


def test_expert_x_tensor_refuses_a_loops_norm_clipping_as_fit_does():
  strategy = EXPERT_LAYOUTS["data 2 x tensor 2, expert 2"][0]()
  with strategy.scope():
    model = _small_moe_model()
    optimizer = keras.optimizers.Adam(global_clipnorm=0.5)
    with pytest.raises(ValueError, match="global_clipnorm=0.5: expert x "
                       "tensor parallelism does not clip by norm"):
      optimizer.build(model.trainable_variables)


def test_a_pipeline_refuses_a_custom_loops_optimizer():
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2)
  with strategy.scope():
    model = _create_model()
    optimizer = keras.optimizers.Adam()
    with pytest.raises(ValueError, match="PipelineParallelStrategy .* "
                       "custom training loop .* train with fit"):
      optimizer.build(model.trainable_variables)
