"""Expert parallelism (`tfpar.ExpertParallelStrategy`) on keras-hub's
Mixtral and Qwen-MoE, against one device.

Each trained layout is run once (module-scoped) and checked several ways:
every step's loss and every whole weight against one device, the bytes
of expert weights (and Adam slots) on each device counted from the
per-device tf.Variables, and the all-to-all count and bytes of one step
against the formula.
"""

import collections
import re

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import tfpar
from tfpar.common import whole_weights
from tfpar.expert_parallel import routing

VOCAB, SEQUENCE, BATCH, STEPS = 64, 8, 8, 10
HIDDEN, EXPERTS, TOP_K = 32, 4, 2

BACKBONES = {
    "mixtral": lambda **kw: keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=HIDDEN, intermediate_dim=64,
        num_experts=kw.get("num_experts", EXPERTS),
        top_k=kw.get("top_k", TOP_K),
        router_jitter_noise=kw.get("router_jitter_noise", 0.0)),
    "qwen_moe": lambda **kw: keras_hub.models.QwenMoeBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=HIDDEN, intermediate_dim=64,
        moe_intermediate_dim=32, shared_expert_intermediate_dim=64,
        num_experts=kw.get("num_experts", EXPERTS),
        top_k=kw.get("top_k", TOP_K), router_aux_loss_coefficient=0.02),
}


def language_model(family, **config):
  keras.utils.set_random_seed(1)
  backbone = BACKBONES[family](**config)
  logits = backbone.token_embedding(backbone.output, reverse=True)
  return keras.Model(backbone.input, logits, name=f"{family}_lm")


def dataset():
  """Fixed-size batches (static shapes, so bytes are known), with some
  padding at the end of each sequence."""
  rng = np.random.default_rng(0)
  ids = rng.integers(1, VOCAB, size=(BATCH * STEPS, SEQUENCE + 1)).astype(
      "int32")
  mask = np.ones((BATCH * STEPS, SEQUENCE), "int32")
  mask[:, -2:] = rng.integers(0, 2, size=(BATCH * STEPS, 2))
  inputs = {"token_ids": ids[:, :-1], "padding_mask": mask}
  return tf.data.Dataset.from_tensor_slices((inputs, ids[:, 1:])).batch(
      BATCH, drop_remainder=True)


def train(family, optimizer_name, strategy=None, log=None):
  """(model, per-step losses) after STEPS steps of `fit`."""
  scope = strategy.scope() if strategy else tf.distribute.get_strategy(
      ).scope()
  with scope:
    model = language_model(family)
    model.compile(
        optimizer=hub_common.optimizer(optimizer_name),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  losses = []
  record = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))
  if log is None:
    model.fit(dataset(), epochs=1, verbose=0, callbacks=[record])
  else:
    with log:
      model.fit(dataset(), epochs=1, verbose=0, callbacks=[record])
  return model, np.array(losses)


def expert_parallel(expert, capacity_factor=None):
  return tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 4}), expert=expert,
                                      capacity_factor=capacity_factor)


def _anonymous(path):
  """`path` without Keras's per-instance name suffixes (`block_3`), which
  differ between two copies of a model built in one process."""
  return re.sub(r"_\d+(?=/|$)", "", path)


def max_weight_difference(model, reference):
  """The largest difference between the whole weights of two copies of a
  model, weight by weight in layer order."""
  ours = list(tfpar.logical_weights(model).items())
  theirs = list(tfpar.logical_weights(reference).items())
  assert [_anonymous(k) for k, _ in ours] == [_anonymous(k) for k, _ in theirs]
  assert any("/experts/" in k for k, _ in ours)
  return max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(ours, theirs))


def assert_weights_listed_whole(model, reference, atol):
  """`model.weights` (and each layer's `weights`, `count_params`) list
  exactly `reference`'s (one device's) arrays: count, order, shapes and
  values; `trainable_weights` keeps the variables held (local experts)."""
  ours = [w.numpy() for w in model.weights]
  theirs = [w.numpy() for w in reference.weights]
  assert [a.shape for a in ours] == [b.shape for b in theirs]
  assert [_anonymous(w.path) for w in model.weights] == [
      _anonymous(w.path) for w in reference.weights]
  assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) < atol
  assert [np.asarray(w).shape for w in model.weights] == [
      a.shape for a in ours]
  assert model.count_params() == reference.count_params()
  experts = [w for w in model.weights if "/experts/" in w.path]
  assert experts and all(type(w).__name__ == "ExpertWeight" for w in experts)
  for layer, twin in zip(model.layers, reference.layers):
    assert [tuple(w.shape) for w in layer.weights] == [
        tuple(w.shape) for w in twin.weights]
  held = whole_weights.held(model)
  assert len(held) > len(model.weights) or any(
      "_experts" in v.path for v in held)
  assert all(type(v).__name__ != "ExpertWeight"
             for v in model.trainable_weights + model.non_trainable_weights)
  assert {id(v) for v in model.trainable_weights} == {
      id(v) for v in model.trainable_variables}


def assert_ranks_hold_their_experts(variable, expert):
  """Replicas of one expert group hold different experts in `variable`,
  replicas of the same expert rank the same ones."""
  components = variable._value.values  # pylint: disable=protected-access
  values = [c.numpy() for c in components]
  for replica in range(len(values)):
    for other in range(len(values)):
      same = replica % expert == other % expert
      assert np.array_equal(values[replica], values[other]) == same


def expert_bytes_by_device(variables):
  """{device: bytes} of the components of `variables` (tf.Variables on
  each device), counted from the components themselves."""
  found = collections.Counter()
  for variable in variables:
    value = getattr(variable, "_value", variable)
    for component in getattr(value, "values", (value,)):
      device = tf.DeviceSpec.from_string(component.device).to_string()
      found[device] += int(np.prod(component.shape)) * component.dtype.size
  return found


@pytest.fixture(scope="module")
def mixtral_sgd():
  reference = train("mixtral", "sgd")
  log = tfpar.CommunicationLog()
  strategy = expert_parallel(2)
  model, losses = train("mixtral", "sgd", strategy, log)
  return reference, (model, losses), strategy, log


@pytest.fixture(scope="module")
def mixtral_adam_expert4():
  reference = train("mixtral", "adam")
  strategy = expert_parallel(4)
  return reference, train("mixtral", "adam", strategy), strategy


def test_mixtral_expert2_trains_as_one_device(mixtral_sgd, tmp_path):
  (reference, reference_losses), (model, losses), strategy, _ = mixtral_sgd
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  assert max_weight_difference(model, reference) < 1e-5
  # Inference (replica path, no auxiliary loss) too.
  np.testing.assert_allclose(model.evaluate(dataset(), verbose=0),
                             reference.evaluate(dataset(), verbose=0),
                             atol=1e-5)
  # get_weights gives whole experts, as one device does.
  ours, theirs = model.get_weights(), reference.get_weights()
  assert [w.shape for w in ours] == [w.shape for w in theirs]
  assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) < 1e-5
  # So does Keras's `weights` list (whole experts in one device's places).
  assert_weights_listed_whole(model, reference, 1e-5)
  # save_weights writes whole experts: they load into one device.
  model.save_weights(tmp_path / "experts.weights.h5")
  single = language_model("mixtral")
  single.load_weights(tmp_path / "experts.weights.h5")
  assert max_weight_difference(single, model) == 0.0
  report = strategy.routing_report()
  assert len(report) == 2
  # Every token of every step (training, then evaluation) routed twice,
  # none dropped.
  assert all(v == (0, 2 * BATCH * SEQUENCE * STEPS * TOP_K)
             for v in report.values())


def assert_same_optimizer_state(model, reference):
  """The optimizer saves the arrays (keys, shapes) one device saves, close
  to its values (Adam's moments of whole experts)."""
  ours, theirs = {}, {}
  model.optimizer.save_own_variables(ours)
  reference.optimizer.save_own_variables(theirs)
  assert sorted(ours) == sorted(theirs)
  for key in theirs:
    assert ours[key].shape == theirs[key].shape
    np.testing.assert_allclose(ours[key], theirs[key], atol=1e-3)


def test_mixtral_expert4_adam_trains_as_one_device(mixtral_adam_expert4):
  (reference, reference_losses), (model, losses), _ = mixtral_adam_expert4
  # The optimizer saves whole Adam moments of the experts, the arrays
  # (count, order, shapes) one device saves.
  assert_same_optimizer_state(model, reference)
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  # Adam divides each gradient by its own running size, so float rounding
  # in near-zero gradients moves weights by up to ~lr: measured 1.1e-4
  # here, and 2.8e-3 for stock MirroredStrategy (data 4) against one
  # device on this model (without the auxiliary loss, which it would
  # compute per replica).
  assert max_weight_difference(model, reference) < 2e-4


@pytest.mark.parametrize("fixture, expert", [("mixtral_sgd", 2),
                                             ("mixtral_adam_expert4", 4)])
def test_each_device_holds_its_share_of_the_experts(request, fixture,
                                                    expert):
  model = request.getfixturevalue(fixture)[1][0]
  reference = request.getfixturevalue(fixture)[0][0]
  expert_paths = [v.path for v in reference.weights if "/experts/" in v.path]
  whole = sum(int(np.prod(v.shape)) * 4 for v in reference.weights
              if "/experts/" in v.path)
  # The variables held (`model.weights` lists the whole experts).
  experts = [v for v in whole_weights.held(model) if "/experts/" in v.path]
  assert len(experts) == len(expert_paths) == 6
  per_device = expert_bytes_by_device(experts)
  assert len(per_device) == 4
  assert set(per_device.values()) == {whole // expert}
  # Their optimizer slots (momentum / Adam moments) too.
  slots = [v for v in model.optimizer.variables
           if "experts" in v.path or "expert_feedforward" in v.name]
  assert slots
  slot_bytes = expert_bytes_by_device(slots)
  assert set(slot_bytes.values()) == {whole // expert * (len(slots) // 6)}
  assert_ranks_hold_their_experts(experts[0], expert)


def test_all_to_all_bytes_match_the_formula(mixtral_sgd):
  *_, log = mixtral_sgd
  layers, expert = 2, 2
  tokens = BATCH // 4 * SEQUENCE  # One replica's tokens per step.
  capacity = tokens  # capacity_factor=None: an expert can take them all.
  buffer = EXPERTS * capacity * HIDDEN * 4  # float32 dispatch buffer.
  per_exchange = buffer * (expert - 1) // expert
  counts, sent = log.counts(), log.bytes()
  for phase in ("forward", "backward"):
    # Dispatch and return, per MoE layer.
    assert counts[("all-to-all", phase)] == 2 * layers
    assert sent[("all-to-all", phase)] == 2 * layers * per_exchange


def test_at_capacity_factor_1_each_routed_copy_crosses_once_each_way():
  # The textbook count (DeepSpeed-MoE, Switch): every token's k copies
  # cross to their experts' members and back, (e - 1) / e of them leave
  # the device: T x k x h x (e - 1) / e elements per all-to-all. With
  # capacity_factor=1.0 the buffer has exactly T x k rows (C = T k / E).
  log = tfpar.CommunicationLog()
  strategy = expert_parallel(4, capacity_factor=1.0)
  train("mixtral", "sgd", strategy, log)
  layers, expert = 2, 4
  tokens = BATCH // 4 * SEQUENCE  # One replica's tokens per step.
  formula = tokens * TOP_K * HIDDEN * 4 * (expert - 1) // expert
  counts, sent = log.counts(), log.bytes()
  for phase in ("forward", "backward"):
    assert counts[("all-to-all", phase)] == 2 * layers
    assert sent[("all-to-all", phase)] == 2 * layers * formula


def test_qwen_moe_expert2_trains_as_one_device():
  reference, reference_losses = train("qwen_moe", "sgd")
  model, losses = train("qwen_moe", "sgd", expert_parallel(2))
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  assert max_weight_difference(model, reference) < 1e-5


def test_capacity_drops_are_counted():
  strategy = expert_parallel(2, capacity_factor=0.5)
  model, losses = train("mixtral", "sgd", strategy)
  assert np.all(np.isfinite(losses))
  report = strategy.routing_report()
  routed = BATCH * SEQUENCE * STEPS * TOP_K
  assert all(r == routed for _, r in report.values())
  # Capacity 0.5 x 16 tokens x 2 / 4 experts = 4 slots per expert and
  # replica: at most 16 of each replica's 32 assignments fit.
  assert all(d >= routed // 2 for d, _ in report.values())
  del model


def test_slots_keep_first_choices_first():
  experts = np.random.default_rng(3).integers(0, 4, size=(50, 2))
  experts[:, 1] = (experts[:, 0] + 1 + experts[:, 1] % 3) % 4
  slot, kept = routing.slots(tf.constant(experts, tf.int32), 4, 7)
  filled = collections.Counter()
  expected_kept = np.zeros_like(experts, bool)
  for choice in range(2):
    for token in range(50):
      e = experts[token, choice]
      if filled[e] < 7:
        expected_kept[token, choice] = True
        filled[e] += 1
  np.testing.assert_array_equal(kept.numpy(), expected_kept)
  # Each expert's kept tokens sit in token order.
  placed = collections.Counter()
  for token in range(50):
    for choice in range(2):
      if expected_kept[token, choice]:
        e = experts[token, choice]
        assert slot.numpy()[token, choice] == e * 7 + placed[e]
        placed[e] += 1
  assert np.all(slot.numpy()[~expected_kept] == 4 * 7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(expert=3), "expert=3 does not divide the mesh's data size 4"),
    (dict(expert=0), "expert must be a positive integer"),
    (dict(expert=2, capacity_factor=0), "capacity_factor must be None"),
    (dict(expert=2, capacity_factor="1"), "capacity_factor must be None"),
])
def test_bad_settings_fail_before_any_work(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 4}), **kwargs)


def test_pipeline_axis_is_refused():
  # A tensor axis is expert x tensor (tests/test_expert_tensor_parallel.py).
  with pytest.raises(ValueError, match="For expert x pipeline use tfpar.PipelineParallelStrategy"):
    tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 2, "pipeline": 2}),
                                 expert=2)


def test_experts_not_divisible_by_the_expert_size_fail_when_built():
  strategy = expert_parallel(4)
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by "
                     "expert=4"):
    with strategy.scope():
      language_model("mixtral", num_experts=6)


def test_top_k_larger_than_the_experts_fails_when_built():
  strategy = expert_parallel(2)
  with pytest.raises(ValueError, match="top_k=5 must be between 1 and "
                     "num_experts=4"):
    with strategy.scope():
      language_model("mixtral", top_k=5)


def _every_component(variables):
  """Each variable's value on every device (every expert rank), flat."""
  from tfpar.memory import components  # pylint: disable=g-import-not-at-top
  return np.concatenate([np.asarray(c.numpy()).ravel() for v in variables
                         for c in components(v)])


def test_tf_train_checkpoint_saves_and_restores_every_rank_s_experts(
    mixtral_adam_expert4, tmp_path):
  # TF saves a distributed variable's first component only: without
  # tfpar's serialization a checkpoint kept rank 0's experts alone, and a
  # restore gave every rank those (weights 0.095 off). Last in the file: it
  # changes the shared model's values and restores them.
  _, (model, _), strategy = mixtral_adam_expert4
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  path = checkpoint.save(str(tmp_path / "ckpt"))
  # Expert kernels and their Adam moments: [experts, 32, 64] / [.., 64, 32]
  # whole, never a rank's [experts / 4, ...] (each object once, at its
  # shortest path: the optimizer's list of trainable variables).
  expert_shapes = [shape for _, shape in tf.train.list_variables(path)
                   if shape[1:] in ([HIDDEN, 64], [64, HIDDEN])]
  assert len(expert_shapes) == 2 * 3 * 3  # 2 layers, 3 kernels, w + m + v.
  assert all(shape[0] == EXPERTS for shape in expert_shapes), expert_shapes
  variables = whole_weights.held(model) + model.optimizer.variables
  before = _every_component(variables)
  with strategy.scope():
    for variable in variables:
      if "float" in str(variable.dtype):
        variable.assign(variable * 0.5 + 1.0)
  assert np.abs(_every_component(variables) - before).max() > 0.5
  checkpoint.restore(path).assert_existing_objects_matched()
  np.testing.assert_array_equal(_every_component(variables), before)
