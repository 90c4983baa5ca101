"""`tfpar.MoE`, a mixture-of-experts layer for users' own models: one
device against `tfpar.ExpertParallelStrategy` (data 4, experts split in
pairs and in fours).

The model is a small functional Keras model of stock layers (Embedding,
Dense, Add) with two MoE layers, one with gated experts (Mixtral's) and
one with plain GELU experts. Each trained layout runs once
(module-scoped) and is checked several ways: every step's loss and every
whole weight against one device, `get_weights`, the bytes of expert
weights on each device counted from the per-device tf.Variables, and the
load-balancing loss each replica computes.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.common import whole_weights
from test_expert_parallel import assert_ranks_hold_their_experts
from test_expert_parallel import expert_bytes_by_device

VOCAB, SEQUENCE, BATCH, STEPS = 32, 8, 8, 10
HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 16, 4, 32, 2
LAYERS = 2


def moe_model(num_experts=EXPERTS):
  keras.utils.set_random_seed(1)
  tokens = keras.Input((SEQUENCE,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, HIDDEN)(tokens)
  x = keras.layers.Add()([x, tfpar.MoE(num_experts, INTERMEDIATE,
                                       top_k=TOP_K)(x)])
  x = keras.layers.Dense(HIDDEN, activation="relu")(x)
  x = keras.layers.Add()([x, tfpar.MoE(num_experts, INTERMEDIATE,
                                       top_k=TOP_K, gated=False,
                                       activation="gelu")(x)])
  return keras.Model(tokens, keras.layers.Dense(VOCAB)(x), name="moe_lm")


def token_ids():
  ids = np.random.default_rng(0).integers(
      0, VOCAB, size=(BATCH * STEPS, SEQUENCE + 1))
  return ids.astype("int32")


def optimizer(name):
  if name == "adam":
    return keras.optimizers.Adam(0.01)
  return keras.optimizers.SGD(0.1, momentum=0.9)


def train(optimizer_name, strategy=None):
  """(model, per-step losses) after STEPS steps of `fit`."""
  scope = strategy.scope() if strategy else tf.distribute.get_strategy(
      ).scope()
  with scope:
    model = moe_model()
    model.compile(
        optimizer=optimizer(optimizer_name),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  ids = token_ids()
  losses = []
  model.fit(ids[:, :-1], ids[:, 1:], batch_size=BATCH, shuffle=False,
            verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: losses.append(
                    logs["loss"]))])
  return model, np.array(losses)


def expert_parallel(expert):
  return tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 4}), expert=expert)


def _anonymous(path):
  """`path` without Keras's per-instance name suffixes (`moe_3`)."""
  return re.sub(r"_\d+(?=/|$)", "", path)


def max_weight_difference(model, reference):
  ours = list(tfpar.logical_weights(model).items())
  theirs = list(tfpar.logical_weights(reference).items())
  assert [_anonymous(k) for k, _ in ours] == [_anonymous(k) for k, _ in theirs]
  return max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(ours, theirs))


def _trained(optimizer_name, expert):
  reference = train(optimizer_name)
  strategy = expert_parallel(expert)
  return reference, train(optimizer_name, strategy), strategy


@pytest.fixture(scope="module")
def sgd_expert2():
  return _trained("sgd", 2)


@pytest.fixture(scope="module")
def adam_expert4():
  return _trained("adam", 4)


@pytest.mark.parametrize("fixture", ["sgd_expert2", "adam_expert4"])
def test_trains_as_one_device(request, fixture):
  (reference, reference_losses), (model, losses), strategy = (
      request.getfixturevalue(fixture))
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  assert max_weight_difference(model, reference) < 1e-5
  ours, theirs = model.get_weights(), reference.get_weights()
  assert [w.shape for w in ours] == [w.shape for w in theirs]
  assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) < 1e-5
  # Each token of each step routed TOP_K times, none dropped.
  report = strategy.routing_report()
  assert len(report) == LAYERS
  assert set(report.values()) == {(0, BATCH * SEQUENCE * STEPS * TOP_K)}


def test_saved_weights_load_into_one_device(sgd_expert2, tmp_path):
  _, (model, _), _ = sgd_expert2
  model.save_weights(tmp_path / "moe.weights.h5")
  single = moe_model()
  single.load_weights(tmp_path / "moe.weights.h5")
  assert max_weight_difference(single, model) == 0.0


@pytest.mark.parametrize("fixture, expert", [("sgd_expert2", 2),
                                             ("adam_expert4", 4)])
def test_each_device_holds_its_share_of_the_experts(request, fixture,
                                                    expert):
  (reference, _), (model, _), _ = request.getfixturevalue(fixture)
  whole = sum(int(np.prod(v.shape)) * 4 for v in reference.weights
              if "/experts/" in v.path)
  # Gated: gate, up [4, 16, 32] and down [4, 32, 16]; plain: up, down.
  assert whole == 5 * EXPERTS * HIDDEN * INTERMEDIATE * 4
  experts = [v for v in whole_weights.held(model) if "/experts/" in v.path]
  assert len(experts) == 5
  per_device = expert_bytes_by_device(experts)
  assert len(per_device) == 4
  assert set(per_device.values()) == {whole // expert}
  assert_ranks_hold_their_experts(experts[0], expert)


def _aux_losses_per_replica(model, strategy, tokens):
  """[replica][layer] load-balancing losses of `model` on `tokens`."""
  dataset = tf.data.Dataset.from_tensor_slices(tokens).batch(len(tokens))
  batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

  def forward(x):
    model(x, training=True)
    return tf.stack(model.losses)

  per_replica = tf.function(lambda x: strategy.run(forward, args=(x,)))(batch)
  return np.stack([np.asarray(v) for v in
                   strategy.experimental_local_results(per_replica)])


def test_load_balancing_loss_is_one_device_s(sgd_expert2):
  (reference, _), (model, _), strategy = sgd_expert2
  tokens = token_ids()[:BATCH, :-1]
  reference(tokens, training=True)
  expected = np.array([float(loss) for loss in reference.losses])
  assert len(expected) == LAYERS and np.all(expected > 0)
  ours = _aux_losses_per_replica(model, strategy, tokens)
  # Every replica has the loss of the whole batch (measured 1.9e-9 off),
  # not that of its own share (2.6e-5 to 1.3e-4 off).
  assert ours.shape == (4, LAYERS)
  np.testing.assert_allclose(ours, np.tile(expected, (4, 1)), atol=1e-7)


def test_masked_tokens_do_not_count_in_the_load_balancing_loss():
  keras.utils.set_random_seed(2)
  tokens = token_ids()[:BATCH, :-1].copy()
  tokens[:, -3:] = 0  # Padding.
  embedding = keras.layers.Embedding(VOCAB, HIDDEN, mask_zero=True)
  moe = tfpar.MoE(EXPERTS, INTERMEDIATE)
  x = embedding(tokens)
  moe(x, training=True)  # Keras passes the embedding's mask.
  masked = float(moe.losses[0])
  moe(tf.boolean_mask(x, tokens != 0), training=True)
  assert masked == pytest.approx(float(moe.losses[0]), abs=1e-7)
  moe(tf.identity(x), training=True)  # Without the mask.
  assert abs(masked - float(moe.losses[0])) > 1e-5


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, intermediate_dim=8, top_k=5),
     r"top_k=5 must be between 1 and num_experts=4"),
    (dict(num_experts=0, intermediate_dim=8),
     r"num_experts must be a positive integer. Received: num_experts=0"),
    (dict(num_experts=4, intermediate_dim=8, top_k=0),
     r"top_k must be a positive integer"),
    (dict(num_experts=4, intermediate_dim=8, aux_loss_coefficient=-1),
     r"aux_loss_coefficient must be a number >= 0"),
])
def test_bad_settings_fail_when_the_layer_is_made(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tfpar.MoE(**kwargs)


def test_experts_not_divisible_by_the_expert_size_fail_before_training():
  strategy = expert_parallel(4)
  with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by "
                     r"expert=4"):
    with strategy.scope():
      moe_model(num_experts=6)


def test_config_round_trip_and_saved_model(tmp_path):
  layer = tfpar.MoE(EXPERTS, INTERMEDIATE, top_k=1, gated=False,
                    activation="relu", normalize_top_k=False,
                    aux_loss_coefficient=0.5, name="ffn")
  copy = keras.layers.deserialize(keras.layers.serialize(layer))
  assert isinstance(copy, tfpar.MoE)
  assert copy.get_config() == layer.get_config()
  model = moe_model()
  tokens = token_ids()[:2, :-1]
  model.save(tmp_path / "moe.keras")
  loaded = keras.saving.load_model(tmp_path / "moe.keras")
  np.testing.assert_array_equal(loaded.predict(tokens, verbose=0),
                                model.predict(tokens, verbose=0))


def test_clipping_by_global_norm_equals_one_device():
  # tfpar clips after the sums over replicas, by the norm of the whole
  # gradients (the experts' squares summed over their expert group); Keras
  # alone clips each replica's partial gradient. Measured: 3.0e-8 off one
  # device (the same as without clipping).
  clipped = lambda: keras.optimizers.SGD(0.1, momentum=0.9,
                                         global_clipnorm=0.05)
  ids = token_ids()
  model = moe_model()
  with tf.GradientTape() as tape:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        ids[:BATCH, 1:], model(ids[:BATCH, :-1]))
  norm = tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables))
  assert float(norm) > 2 * 0.05  # The first step clips.
  trained = []
  for strategy in (None, expert_parallel(2)):
    scope = strategy.scope() if strategy else tf.distribute.get_strategy(
        ).scope()
    with scope:
      model = moe_model()
      model.compile(
          optimizer=clipped(),
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ids[:, :-1], ids[:, 1:], batch_size=BATCH, shuffle=False,
              verbose=0)
    trained.append(model)
  assert max_weight_difference(trained[1], trained[0]) < 1e-6
