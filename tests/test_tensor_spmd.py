"""TensorParallelStrategy(spmd=True) trains the same model as one device.

Each layout fits a one-block GPT of tp_common (vocabulary-split
embeddings, attention split by heads, a column/row MLP) for 8 steps and is
compared with the same model fitted without a strategy: every step's
loss, every logical weight, Keras's weight API, predict and evaluate (with
a metric that counts examples, so a replica counted once per tensor device
would show). The communication log shows one all-reduce per Megatron f/g
on every device, each sending the ring's 2 (t - 1) / t of its activation;
with sequence parallelism reduce-scatters and all-gathers instead. Mixed
policies are held to stock MirroredStrategy's spread from one device.

keras-hub backbones (GPT-2; Llama with fewer key/value heads than
devices) and gradient clipping and accumulation are compared with one
device under the same settings.
"""

import contextlib

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import precision_common
import stock_strategies
import suite_scope
import tfpar
import tp_common

STEPS = 8
# (layout, optimizer, sequence_parallel)
CASES = [({"data": 2, "tensor": 2}, "adam", False),
         ({"data": 1, "tensor": 4}, "sgd", False),
         ({"data": 2, "tensor": 2}, "adam", True)]
# Tensor 4 and sequence parallelism with TFPAR_TEST_FULL=1:
# test_tensor_parallel trains the GPT on data 1 x tensor 4 and
# test_tensor_parallel_sequence with sequence parallelism, both under SPMD
# (the default), with the same per-device collective checks.
TRAINED = suite_scope.cases([0], [1, 2])


class Count(keras.metrics.Metric):
  """How many examples were seen."""

  def __init__(self, name="count", **kwargs):
    super().__init__(name=name, **kwargs)
    self.seen = self.add_variable(shape=(), initializer="zeros", name="seen")

  def update_state(self, y_true, y_pred, sample_weight=None):
    del y_pred, sample_weight
    self.seen.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

  def result(self):
    return self.seen


def _model(optimizer):
  model = tp_common.gpt(blocks=1)
  model.compile(
      optimizer=(keras.optimizers.Adam(0.01) if optimizer == "adam" else
                 keras.optimizers.SGD(0.1)),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=[Count()])
  return model


def _strategy(layout, **kwargs):
  devices = tf.config.list_logical_devices("CPU")[:layout["data"] *
                                                 layout["tensor"]]
  return tfpar.TensorParallelStrategy(
      tfpar.Mesh(layout, [d.name for d in devices]), spmd=True, **kwargs)


def _data():
  return tp_common.data("gpt", count=tp_common.BATCH * STEPS)


@pytest.fixture(scope="module")
def references():
  found = {}
  for optimizer in ("adam", "sgd"):
    model = _model(optimizer)
    found[optimizer] = (model, tp_common.step_losses(model, *_data(),
                                                     epochs=1))
  return found


@pytest.fixture(scope="module")
def runs():
  done = {}

  def run(layout, optimizer, sequence_parallel=False):
    key = (tuple(layout.items()), optimizer, sequence_parallel)
    if key not in done:
      strategy = _strategy(layout, sequence_parallel=sequence_parallel)
      with strategy.scope():
        model = _model(optimizer)
      with tfpar.CommunicationLog() as log:
        losses = tp_common.step_losses(model, *_data(), epochs=1)
      done[key] = (strategy, model, losses, log)
    return done[key]
  return run


@pytest.mark.parametrize("layout,optimizer,sequence_parallel",
                         [CASES[case] for case in TRAINED],
                         ids=lambda c: str(c))
def test_trains_like_one_device(references, runs, layout, optimizer,
                                sequence_parallel):
  reference, reference_losses = references[optimizer]
  strategy, model, losses, _ = runs(layout, optimizer, sequence_parallel)
  assert strategy.num_replicas_in_sync == layout["data"]
  assert len(losses) == STEPS
  tp_common.assert_trains_like(model, losses, reference, reference_losses)
  assert [w.path for w in model.weights] == [w.path for w in
                                              reference.weights]
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  assert model.count_params() == reference.count_params()
  x, y = tp_common.data("gpt", count=20, seed=7)  # An uneven last batch.
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             reference.predict(x, batch_size=8, verbose=0),
                             atol=1e-5, rtol=0)
  got = model.evaluate(x, y, batch_size=8, verbose=0)
  want = reference.evaluate(x, y, batch_size=8, verbose=0)
  assert got[1] == want[1] == 20  # Each example counted once.
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_split_weights_hold_their_shard_on_every_device(runs):
  strategy, model, _, _ = runs({"data": 2, "tensor": 2}, "adam")
  layer = model.get_layer("block0_mlp_in")
  whole = [w for w in model.weights if w.path == "block0_mlp_in/kernel"][0]
  assert tuple(whole.shape) == (16, 64) and tuple(layer.kernel.shape) == (
      16, 32)
  components = layer.kernel.value.values  # The mirrored storage.
  spec = lambda d: tf.DeviceSpec.from_string(d).replace(job=None,
                                                        replica=None,
                                                        task=None)
  assert [spec(c.device) for c in components] == [
      spec(d) for g in strategy.mesh.replicas for d in g]
  shards = np.split(whole.numpy(), 2, axis=1)
  for index, component in enumerate(components):
    np.testing.assert_array_equal(component.numpy(), shards[index % 2])


@pytest.mark.parametrize("case", [c for c in TRAINED if c < 2],
                         ids=lambda c: ["2x2", "1x4"][c])
def test_each_device_sends_the_ring_share(runs, case):
  layout, optimizer, _ = CASES[case]
  _, _, _, log = runs(layout, optimizer)
  t = layout["tensor"]
  batch = tp_common.BATCH // layout["data"]
  activation = batch * tp_common.SEQUENCE * tp_common.WIDTH * 4
  for replica in range(layout["data"]):
    per_device = {}
    for record in log.step_records(replica):
      assert record.kind == "all-reduce"
      assert record.bytes == 2 * (t - 1) * activation // t
      device = record.tensor.device
      per_device.setdefault(device, []).append(record.phase)
    assert len(per_device) == t
    for phases in per_device.values():
      # Forward: two embeddings, attention and MLP outputs (g); backward:
      # the attention and MLP inputs (f, once for query, key and value).
      assert sorted(phases) == ["backward"] * 2 + ["forward"] * 4


@pytest.mark.parametrize("case", [c for c in TRAINED if c == 2])
def test_sequence_parallel_moves_slices(runs, case):
  layout, optimizer, _ = CASES[case]
  _, _, _, log = runs(layout, optimizer, True)
  t = 2
  activation = tp_common.BATCH // 2 * tp_common.SEQUENCE * tp_common.WIDTH * 4
  per_device = {}
  for record in log.step_records(0):
    kinds = per_device.setdefault(record.tensor.device, [])
    if record.kind == "all-reduce":  # LayerNorm and row bias gradients.
      assert record.phase == "backward" and record.bytes == 4 * tp_common.WIDTH
      kinds.append("weights")
      continue
    assert record.bytes == (t - 1) * activation // t, record
    kinds.append((record.kind, record.phase))
  assert len(per_device) == t
  for kinds in per_device.values():
    assert sorted(kinds, key=str) == sorted(
        # Reduce-scatters: embeddings, attention and MLP outputs, and
        # backward the attention and MLP inputs; all-gathers: those inputs,
        # the final LayerNorm's output for the head, and backward the
        # reduce-scatters'; 3 LayerNorms and 2 row biases' gradients.
        [("reduce-scatter", "forward")] * 4 +
        [("reduce-scatter", "backward")] * 2 +
        [("all-gather", "forward")] * 3 +
        [("all-gather", "backward")] * 4 + ["weights"] * 8, key=str)


def test_layers_outside_a_column_row_pair_gather_or_slice():
  # pair1_in is row-parallel on the model's (replicated) input: each device
  # takes its slice. pair2_out is column-parallel with nothing after it:
  # its output is all-gathered. pair1_out / pair2_in stay replicated.
  plan = [(r"pair1_in/kernel", tfpar.RowParallel()),
          (r"pair2_out/kernel", tfpar.ColumnParallel())]
  x, y = tp_common.data("mlp", count=32)

  def fitted(strategy=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = tp_common.mlp()
      model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model, tp_common.step_losses(model, x, y, epochs=1)

  reference, reference_losses = fitted()
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}), plan=plan, spmd=True)
  with tfpar.CommunicationLog() as log:
    model, losses = fitted(strategy)
  kinds = {(r.kind, r.phase) for r in log.step_records(0)}
  # Row layers sum partial results (g); the column layer's input gradient
  # is summed (f); its output and the row layer's input gradient gathered.
  assert kinds == {("all-gather", "forward"), ("all-gather", "backward"),
                   ("all-reduce", "forward"), ("all-reduce", "backward")}
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5, rtol=0)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_saved_weights_and_optimizer_state_are_whole_and_reload(runs, references,
                                                     tmp_path):
  _, model, _, _ = runs({"data": 2, "tensor": 2}, "adam")
  reference, _ = references["adam"]
  path = str(tmp_path / "spmd.keras")
  model.save(path)
  # Into another layout (its optimizer, built whole, moves to the shards),
  # saved again, then onto one device.
  with _strategy({"data": 1, "tensor": 4}).scope():
    resharded = keras.models.load_model(path, custom_objects={"Count": Count})
  path = str(tmp_path / "resharded.keras")
  resharded.save(path)
  loaded = keras.models.load_model(path, custom_objects={"Count": Count})
  for got, want in zip(loaded.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  tp_common.assert_same_optimizer_state(loaded, reference)


def test_unsupported_settings_raise_before_any_work():
  layout = {"data": 1, "tensor": 2}
  # Dropout in split attention and on sequence slices no longer raises
  # (tests/test_tensor_spmd_dropout.py); a noise_shape fixing the size of
  # a split axis does.
  with pytest.raises(ValueError, match=r"noise_shape=\(1, 8, 16\)"):
    with _strategy(layout, sequence_parallel=True).scope():
      inputs = keras.Input((8, 16))
      hidden = keras.layers.Dense(32, activation="gelu")(inputs)
      keras.Model(inputs, keras.layers.Dropout(0.2, noise_shape=(1, 8, 16))(
          keras.layers.Dense(16)(hidden)))
  with pytest.raises(ValueError, match="spmd must be one of None, True"):
    tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 4}), spmd="yes")
  for strategy_class, options in (
      (tfpar.TensorParallelStrategy, {}),
      (tfpar.ExpertParallelStrategy, {"expert": 2}),
      (tfpar.PipelineParallelStrategy, {"num_microbatches": 2})):
    with pytest.raises(ValueError, match=strategy_class.__name__ +
                       r"\(spmd=False\): the replica-head .* retired"):
      strategy_class(tfpar.Mesh({"data": 2, "tensor": 2}), spmd=False,
                     **options)
  x, y = tp_common.data("mlp", count=8)
  strategy = _strategy(layout)
  with strategy.scope():
    model = tp_common.mlp()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
  for run in (model.fit, model.evaluate):
    with pytest.raises(ValueError, match=r"run_eagerly=True on model .*"
                       r"compile with run_eagerly=False"):
      run(x, y, batch_size=8, verbose=0)
  assert not model.optimizer.built  # Refused before any work.
  with pytest.raises(ValueError, match=r"eager strategy.run; call it inside "
                     r"a tf.function"):
    strategy.run(lambda: 1.0)


def _mixed_run(policy, strategy=None):
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = tp_common.compile_model(tp_common.gpt(blocks=1))
    losses = tp_common.step_losses(model, *_data(), epochs=1)
    return losses, model.get_weights()
  finally:
    keras.mixed_precision.set_global_policy("float32")


# data 2 x tensor 2 under mixed_bfloat16 with TFPAR_TEST_FULL=1:
# test_keras_hub_precision trains Llama ten steps so (SPMD, the default),
# and the precision matrix this GPT with compute-dtype sums.
@pytest.mark.parametrize("policy,layout,sequence_parallel", suite_scope.cases(
    [("mixed_float16", {"data": 1, "tensor": 2}, True)],
    [("mixed_bfloat16", {"data": 2, "tensor": 2}, False)]))
def test_mixed_policy_within_mirrored_spread(policy, layout,
                                             sequence_parallel):
  # Partial sums cross in float32 and are rounded once (the default
  # communication_dtype): the forward rounds as one device's, and training
  # stays within stock Mirrored's spread from one device (loss scaling
  # skips the same steps on every device under mixed_float16).
  reference = _mixed_run(policy)
  mirrored = _mixed_run(policy, stock_strategies.mirrored(
      tfpar.Mesh().devices[:2]))
  spmd = _mixed_run(policy, _strategy(layout,
                                      sequence_parallel=sequence_parallel))
  spread = precision_common.differences(*mirrored, *reference)
  measured = precision_common.differences(*spmd, *reference)
  # The first loss, before any update: as one device's but for float32
  # rounding of the mean over the data replicas (far below the policy's).
  assert measured[2] <= 1e-6, measured
  precision_common.assert_within_spread(policy, False, measured, spread,
                                        first_loss=reference[0][0])


def test_describe_lists_replicated_weights_on_every_device(runs):
  strategy, model, _, _ = runs({"data": 2, "tensor": 2}, "adam")
  rows = {line.split()[0]: line for line in strategy.describe(
      model, print_fn=None).splitlines()}
  assert rows["final_ln/gamma"].endswith("CPU:0,CPU:1,CPU:2,CPU:3")
  assert rows["block0_mlp_in/kernel"].endswith(
      "0: CPU:0,CPU:2 | 1: CPU:1,CPU:3")


# keras-hub backbones, the smallest configs that split every kind of layer
# (1 block, hidden 16, 4 query heads, the tied embedding; Llama's 2
# key/value heads shared by 2 devices each at tensor 4), with clipping and
# accumulation settings.
_HUB = dict(vocabulary_size=hub_common.VOCAB, num_layers=1, hidden_dim=16,
            intermediate_dim=32)
# GPT-2 with TFPAR_TEST_FULL=1: test_keras_hub trains it on data 2 x
# tensor 2 (SPMD by default) and test_gradient_accumulation accumulates
# under tensor parallelism.
HUB_CASES = suite_scope.cases(
    [pytest.param("llama", {"data": 1, "tensor": 4},
                  lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.2),
                  id="llama-1x4-gqa-global_clipnorm")],
    [pytest.param("gpt2", {"data": 2, "tensor": 2},
                  lambda: keras.optimizers.SGD(0.1, momentum=0.9,
                                               clipnorm=0.05,
                                               gradient_accumulation_steps=2),
                  id="gpt2-2x2-clipnorm-accumulate")])


def _hub_model(family, **overrides):
  keras.utils.set_random_seed(1)
  if family == "gpt2":
    backbone = keras_hub.models.GPT2Backbone(
        num_heads=4, max_sequence_length=hub_common.SEQUENCE,
        **{"dropout": 0.0, **_HUB, **overrides})
  else:
    backbone = keras_hub.models.LlamaBackbone(
        **{"num_query_heads": 4, "num_key_value_heads": 2, **_HUB,
           **overrides})
  # The tied output head: the token embedding reversed (a CausalLM's).
  return keras.Model(backbone.input,
                     backbone.token_embedding(backbone.output, reverse=True))


def _hub_fit(family, optimizer, strategy=None):
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = _hub_model(family)
    model.compile(optimizer=optimizer(), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
  x, y = hub_common.data(family)
  return model, tp_common.step_losses(model, x, y, epochs=1)


@pytest.mark.parametrize("family,layout,optimizer", HUB_CASES)
def test_keras_hub_backbone_trains_like_one_device(family, layout, optimizer):
  reference, reference_losses = _hub_fit(family, optimizer)
  strategy = _strategy(layout)
  model, losses = _hub_fit(family, optimizer, strategy)
  assert len(losses) == hub_common.STEPS
  tp_common.assert_trains_like(model, losses, reference, reference_losses)
  # The clipping settings bind: the first step's one-device gradients are
  # larger than them.
  fresh = _hub_model(family)
  x, y = hub_common.data(family, count=hub_common.BATCH)
  with tf.GradientTape() as tape:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        y, fresh(x))
  grads = tape.gradient(loss, fresh.trainable_variables)
  norm = float(tf.linalg.global_norm(
      [tf.convert_to_tensor(g) for g in grads]))
  assert norm > 2 * (optimizer().global_clipnorm or optimizer().clipnorm)
  # Tensor 4 > 2 key/value heads: their kernels stay whole on every device
  # (each computes the head its query heads use; gradients summed).
  if family == "llama":
    layer = model.get_layer("transformer_layer_0")._self_attention_layer
    assert tuple(layer._key_dense.kernel.shape) == (16, 2, 4)
    assert tuple(layer._query_dense.kernel.shape) == (16, 1, 4)


def test_keras_hub_settings_it_cannot_split_exactly_raise():
  layout = {"data": 1, "tensor": 2}
  with pytest.raises(ValueError, match="3 key/value heads"):
    with _strategy(layout).scope():  # Neither 3 % 2 nor 2 % 3 is 0.
      _hub_model("llama", num_query_heads=6, num_key_value_heads=3,
                 hidden_dim=12)
  # Sequence parallelism runs keras-hub blocks on slices
  # (tests/test_tensor_spmd_sequence.py); what it cannot run raises there.
