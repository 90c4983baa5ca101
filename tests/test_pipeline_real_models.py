"""PipelineParallelStrategy on models nobody here wrote: keras-hub backbones
(dict inputs, integer padding masks crossing every cut, a tied embedding
used by the first and the last stage) and keras.applications CNNs with
skip connections and batch normalization."""

import collections
import contextlib
import functools
import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import suite_scope
import tfpar

MICROBATCHES = 2


def _strategy(data, pipeline, schedule="1f1b", **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # m < p warns.
    return tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": data, "pipeline": pipeline},
                   devices=tfpar.Mesh().devices[:data * pipeline]),
        num_microbatches=MICROBATCHES, schedule=schedule, **kwargs)


def _device(name):
  return tf.DeviceSpec.from_string(name).to_string()


def _components(variable):
  value = variable._value  # pylint: disable=protected-access
  return getattr(value, "values", (value,))


# keras-hub language models.


def _tied_llama():
  """Llama with its token embedding tied to the logits (keras-hub's
  `tie_word_embeddings=True`): one `ReversibleEmbedding` called by the
  first stage and by the last."""
  keras.utils.set_random_seed(1)
  backbone = keras_hub.models.LlamaBackbone(
      num_query_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
      vocabulary_size=hub_common.VOCAB, num_layers=2, hidden_dim=32,
      intermediate_dim=128)
  logits = backbone.token_embedding(backbone.output, reverse=True)
  return keras.Model(backbone.input, logits, name="llama_tied_lm")


MODELS = {"llama": _tied_llama,
          "gpt2": functools.partial(hub_common.language_model, "gpt2"),
          "bert": functools.partial(hub_common.language_model, "bert")}


def _train_lm(family, optimizer_name, strategy=None):
  scope = strategy.scope() if strategy else tf.init_scope()
  with scope:
    model = MODELS[family]()
    model.compile(
        optimizer=hub_common.optimizer(optimizer_name),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = hub_common.data(family)
  losses = []
  model.fit(x, y, batch_size=hub_common.BATCH, epochs=1, shuffle=False,
            verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: losses.append(
                    logs["loss"]))])
  return model, np.array(losses)


# (family, data, pipeline, schedule, optimizer, recompute)
LM_RUNS = [("llama", 2, 2, "1f1b", "sgd", False),
           ("gpt2", 1, 4, "gpipe", "adam", False),
           ("bert", 2, 2, "1f1b", "adam", True)]


@pytest.fixture(scope="module")
def lm_runs():
  """Each LM_RUNS entry's (one-device, pipelined) training, made once."""
  @functools.cache
  def run(index):
    family, data, pipeline, schedule, optimizer, recompute = LM_RUNS[index]
    reference = _train_lm(family, optimizer)
    strategy = _strategy(data, pipeline, schedule, recompute=recompute)
    return reference, _train_lm(family, optimizer, strategy), strategy
  return run


@pytest.mark.parametrize("index", range(len(LM_RUNS)),
                         ids=["-".join(map(str, r[:4])) for r in LM_RUNS])
def test_keras_hub_language_models_train_as_on_one_device(lm_runs, index):
  (want, want_losses), (model, losses), _ = lm_runs(index)
  assert len(losses) == hub_common.STEPS
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
  # Measured: largest weight difference 3e-8 (llama, SGD) to 4e-6 (Adam).
  assert [w.path for w in model.weights] == [w.path for w in want.weights]
  print(f"\nMEASURED {LM_RUNS[index]}: losses "
        f"{np.abs(losses - want_losses).max():.1e}, weights " +
        f"{max(np.abs(a - b).max() for a, b in zip(model.get_weights(), want.get_weights())):.1e}")
  for got, ref, variable in zip(model.get_weights(), want.get_weights(),
                                model.weights):
    np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=variable.path)


@pytest.mark.parametrize("index", range(len(LM_RUNS)),
                         ids=["-".join(map(str, r[:4])) for r in LM_RUNS])
def test_each_stage_holds_only_its_own_variables(lm_runs, index):
  _, (model, _), strategy = lm_runs(index)
  _, data, pipeline, _, _, _ = LM_RUNS[index]
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  owner = {}
  for stage in plan.stages:
    for layer in stage.layers:
      owner.setdefault(layer.name, stage.index)  # The first caller owns.
  devices = [_device(d) for d in strategy.mesh.devices]
  expected = collections.Counter()
  found = collections.Counter()
  for variable in model.weights:
    stage = owner[variable.path.split("/")[0]]
    nbytes = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
    for replica in range(data):
      expected[devices[replica * pipeline + stage]] += nbytes
    for component in _components(variable):
      found[_device(component.device)] += nbytes
  assert found == expected
  whole = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
              for v in model.weights)
  assert sum(found.values()) == data * whole  # The tied table is held once.
  # Balanced: the most expensive stage is within 30% of the mean, or is one
  # block that no cut can split (GPT-2's 2 blocks on 4 stages: 1.68).
  heaviest = max(plan.stages, key=lambda stage: stage.cost)
  assert plan.imbalance < 1.3 or len(heaviest.layers) == 1, plan.describe()
  print(f"\nMEASURED {LM_RUNS[index]}: imbalance {plan.imbalance:.2f}, "
        f"bytes per device {sorted(found.values())}, one device {whole}")


def test_tied_embedding_is_read_by_the_last_stage_and_held_by_the_first(
    lm_runs):
  _, (model, _), strategy = lm_runs(0)
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  embedding = model.get_layer("token_embedding")
  assert embedding in plan.stages[0].layers
  assert plan.stages[-1].shared == (embedding,)
  assert "shares token_embedding" in strategy.describe_stages(
      model, print_fn=None)
  slots = model.optimizer.variables
  table = embedding.embeddings
  # One momentum slot for the table, on the first stage's devices.
  tied = [v for v in slots if tuple(v.shape) == tuple(table.shape)]
  assert len(tied) == 1
  assert ({_device(c.device) for c in _components(tied[0])} ==
          {_device(c.device) for c in _components(table)})


# keras.applications CNNs.


def _tiny_resnet(batch_norm=False):
  """A stock-layer CNN with residual blocks (batch normalization in each
  block's branch if `batch_norm`)."""
  keras.utils.set_random_seed(2)
  inputs = keras.Input((16, 16, 3))
  x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
  for b in range(3):
    h = keras.layers.Conv2D(8, 3, padding="same", name=f"block{b}_conv1")(x)
    if batch_norm:
      h = keras.layers.BatchNormalization(name=f"block{b}_bn")(h)
    h = keras.layers.Activation("relu", name=f"block{b}_relu")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", name=f"block{b}_conv2")(h)
    x = keras.layers.Add(name=f"block{b}_add")([x, h])
  x = keras.layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, keras.layers.Dense(10)(x),
                     name="tiny_bn_resnet" if batch_norm else "tiny_resnet")


def _mobilenet():
  return keras.applications.MobileNetV2(
      weights=None, input_shape=(32, 32, 3), classes=10, alpha=0.35)


def _resnet50_v2():
  return keras.applications.ResNet50V2(
      weights=None, input_shape=(32, 32, 3), classes=10)


CNNS = {"mobilenet_v2": _mobilenet, "resnet50_v2": _resnet50_v2,
        "tiny_resnet": _tiny_resnet,
        "tiny_bn_resnet": functools.partial(_tiny_resnet, batch_norm=True)}
# (model, data, pipeline, schedule, recompute, steps, dtype). Each schedule
# with and without batch statistics; keras.applications' MobileNetV2
# (inverted residual blocks, batch normalization, 2.3 MB of weights) as the
# real model, under 1F1B with recomputation; ResNet50V2 (23.6M parameters,
# pre-activation residual blocks) cut into 4 stages, GPipe: 23 s (data 2 x
# pipeline 2 with 1F1B and recomputation took 78-190 s).
# MobileNetV2 runs on one replica (58 s on data 2, the suite's slowest
# test); batch statistics over data replicas are tiny_bn_resnet's, and
# TFPAR_TEST_FULL=1 adds MobileNetV2 on data 2, and ResNet50V2 (25-48 s;
# keras.applications is MobileNetV2's, GPipe over skip connections
# tiny_resnet's, 4 stages test_pipeline's).
CNN_RUNS = suite_scope.cases(
    [("tiny_bn_resnet", 2, 2, "gpipe", False, 4, "float64"),
     ("tiny_resnet", 2, 2, "gpipe", False, 6, "float32"),
     ("mobilenet_v2", 1, 2, "1f1b", True, 2, "float64")],
    [("mobilenet_v2", 2, 2, "1f1b", True, 2, "float64"),
     ("resnet50_v2", 1, 4, "gpipe", False, 2, "float64")])


def _cnn(name):
  keras.utils.set_random_seed(3)
  return CNNS[name]()


@contextlib.contextmanager
def _floatx(dtype):
  """Models, losses and the pipeline's loss weights in `dtype`. Keras
  keeps the dtype policy of the first layer built in the process, whatever
  floatx was then, so the policy is set too (without it the CNNs ran in
  float32 after the language models and missed one device by 2%)."""
  previous = keras.config.floatx(), keras.config.dtype_policy()
  keras.config.set_floatx(dtype)
  keras.config.set_dtype_policy(dtype)
  try:
    yield
  finally:
    keras.config.set_floatx(previous[0])
    keras.config.set_dtype_policy(previous[1])


def _images(model, rows, seed=0):
  rng = np.random.default_rng(seed)
  shape = (rows,) + tuple(model.input.shape[1:])
  x = rng.normal(size=shape).astype(model.input.dtype)
  return x, rng.integers(0, 10, size=(rows,)).astype("int32")


def _sgd():
  return keras.optimizers.SGD(0.05, momentum=0.9)


def _loss(model):
  from_logits = model.name.startswith("tiny")
  return keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)


def _microbatch_reference(name, data, batch, steps):
  """One device looping over the pipeline's micro-batches: a forward with
  training=True per micro-batch, gradients summed over the data replicas'
  micro-batches, one optimizer step. Moving statistics take replica 0's
  micro-batches in order (what a MirroredVariable's first copy, the one
  get_weights reads, sees under stock MirroredStrategy too)."""
  model = _cnn(name)
  optimizer, loss_fn = _sgd(), _loss(model)
  parts = data * MICROBATCHES

  @tf.function
  def micro_step(x, y):
    """One micro-batch's loss and gradients (moving statistics updated):
    traced once and called for every micro-batch."""
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True)) / parts
    return loss, tape.gradient(loss, model.trainable_variables)

  def step(x, y):
    total, grads = 0.0, [tf.zeros_like(v) for v in model.trainable_variables]
    xs, ys = tf.split(x, parts), tf.split(y, parts)
    for replica in range(data):
      kept = [tf.identity(v) for v in model.non_trainable_variables]
      for k in range(MICROBATCHES):
        index = replica * MICROBATCHES + k
        loss, micro_grads = micro_step(xs[index], ys[index])
        total += loss
        grads = [g + d for g, d in zip(grads, micro_grads)]
      if replica:
        for variable, value in zip(model.non_trainable_variables, kept):
          variable.assign(value)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return total

  x, y = _images(model, batch * steps)
  losses = [float(step(x[i * batch:(i + 1) * batch],
                       y[i * batch:(i + 1) * batch])) for i in range(steps)]
  # What fit logs: the running mean over the epoch's steps.
  return model, np.cumsum(losses) / np.arange(1, steps + 1)


def _plain_reference(name, batch, steps):
  model = _cnn(name)
  model.compile(optimizer=_sgd(), loss=_loss(model))
  return _fit(model, batch, steps)


def _fit(model, batch, steps):
  x, y = _images(model, batch * steps)
  losses = []
  model.fit(x, y, batch_size=batch, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: losses.append(
                    logs["loss"]))])
  return model, np.array(losses)


@pytest.mark.parametrize("name,data,pipeline,schedule,recompute,steps,dtype",
                         CNN_RUNS,
                         ids=[f"{r[0]}-data{r[1]}" for r in CNN_RUNS])
def test_cnns_with_skip_connections_train_as_on_one_device(
    name, data, pipeline, schedule, recompute, steps, dtype):
  batch = 4 * data * MICROBATCHES
  with _floatx(dtype):
    if name == "tiny_resnet":  # No batch statistics: plain one device.
      want, want_losses = _plain_reference(name, batch, steps)
    else:
      want, want_losses = _microbatch_reference(name, data, batch, steps)
    strategy = _strategy(data, pipeline, schedule, recompute=recompute)
    with strategy.scope():
      model = _cnn(name)
      model.compile(optimizer=_sgd(), loss=_loss(model))
    model, losses = _fit(model, batch, steps)
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  assert len(plan) == pipeline and plan.imbalance < 1.5, plan.describe()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
  # float32 batch statistics of 4 images at 1x1 pixels give MobileNetV2
  # gradients of ~100 that float32 rounding moves by 1% (one device's eager
  # and graph runs differ as much), hence float64 for the BN model.
  for got, ref, variable in zip(model.get_weights(), want.get_weights(),
                                model.weights):
    np.testing.assert_allclose(got, ref, atol=1e-5, err_msg=variable.path)


# Bad input.


def test_cut_inside_a_residual_block_is_an_error():
  strategy = _strategy(2, 2, stages=["block_2_project"])
  with pytest.raises(ValueError, match="cannot be cut before layer "
                     "'block_2_project'.*block_3_expand"):
    with strategy.scope():
      _mobilenet()


def test_cut_name_a_backbone_does_not_have_is_an_error():
  strategy = _strategy(2, 2, stages=["transformer_layer_7"])
  # The backbone, a Functional model made in the scope too, is cut first.
  with pytest.raises(ValueError, match="stages names layer "
                     "'transformer_layer_7', which model 'gpt2_backbone"):
    with strategy.scope():
      hub_common.language_model("gpt2")
