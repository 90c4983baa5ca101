"""ZeRO-3 on models as Keras and keras-hub users build them, two silent
errors found on 2026-11-29:

* Losses a layer adds in its call (`add_loss`, activity regularizers)
  keep their gradients. ZeRO-3 recomputes each unit's call in the
  backward pass, and `tf.recompute_grad` runs the first call off the
  gradient tape: a loss added inside a unit was a constant to the tape
  (an activity-regularized chain ended 6e-4 from one device, the
  regularizer's gradient missing; keras-hub's MoE decoders add their
  router loss this way).
* A model built on another model's output trains all its weights.

And a subclassed model (Keras's subclassing guide) called on a batch in
the scope trains as on one device; one whose layers are not built yet
(`Model.build(input_shape)` builds none of a subclassed model's layers)
is a ValueError before any work under ZeRO-3 and tensor parallelism."""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import pp_common
import tfpar

# The chain's weights fit one bucket: ZeRO-3 recomputes the whole model as
# one unit, so its Dense layers' activity regularizers are added inside
# the recomputed call. 256 bytes: a unit per layer, each regularizer
# outside its layer's recomputed call.
BUCKETS = [None, 256]


def _fit(strategy, model_fn, x, y, epochs, batch):
  scope = strategy.scope() if strategy else tf.init_scope()
  with scope:
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(model))
  losses = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False,
                     verbose=0).history["loss"]
  return model, np.array(losses)


def _loss(model):
  if model.output.shape[-1] == MixtralLanguageModel.VOCAB:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  return "mse"


def _zero3(bucket_bytes, data=4):
  options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
  mesh = tfpar.Mesh({"data": data}, devices=tfpar.Mesh().devices[:data])
  return tfpar.DataParallelStrategy(mesh, zero=tfpar.ZeRO(stage=3, **options))


def _assert_same(model, losses, reference, reference_losses, atol):
  np.testing.assert_allclose(losses, reference_losses, atol=atol)
  for got, want, weight in zip(model.get_weights(), reference.get_weights(),
                               model.weights):
    np.testing.assert_allclose(got, want, atol=atol, err_msg=weight.path)


@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_activity_regularizers_keep_their_gradient(bucket_bytes):
  x, y, _ = pp_common.data()
  model_fn = lambda: pp_common.residual_chain(blocks=2)
  reference, reference_losses = _fit(None, model_fn, x, y, 3, 16)
  model, losses = _fit(_zero3(bucket_bytes), model_fn, x, y, 3, 16)
  _assert_same(model, losses, reference, reference_losses, 1e-6)


class MixtralLanguageModel:
  """A 1-layer keras-hub Mixtral backbone called as a layer, its token
  embedding reversed as the head (as MixtralCausalLM is built), 4 experts,
  top 2, and keras-hub's router load-balancing loss (`add_loss` in the MoE
  block's call) at `router_aux_loss_coef`."""

  VOCAB = 64

  def __init__(self, router_aux_loss_coef):
    self.coefficient = router_aux_loss_coef

  def __call__(self):
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=self.VOCAB, num_layers=1, num_query_heads=2,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=16,
        num_experts=4, top_k=2, router_aux_loss_coef=self.coefficient)
    inputs = {name: keras.Input((None,), dtype="int32", name=name)
              for name in ("token_ids", "padding_mask")}
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    return keras.Model(inputs, logits, name="mixtral_lm")

  @classmethod
  def data(cls, rows=32, sequence=8):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cls.VOCAB, size=(rows, sequence + 1))
    x = {"token_ids": ids[:, :-1].astype("int32"),
         "padding_mask": np.ones((rows, sequence), "int32")}
    return x, ids[:, 1:].astype("int32")


def _data_parallel(data=2):
  return tfpar.DataParallelStrategy(
      tfpar.Mesh({"data": data}, devices=tfpar.Mesh().devices[:data]))


def test_moe_router_loss_keeps_its_gradient():
  # Each replica computes the router loss on its own tokens (a batch
  # statistic, as under stock MirroredStrategy), so the reference is data
  # parallelism without ZeRO.
  x, y = MixtralLanguageModel.data()
  model_fn = MixtralLanguageModel(router_aux_loss_coef=1.0)
  reference, reference_losses = _fit(_data_parallel(), model_fn, x, y, 2, 8)
  model, losses = _fit(_zero3(None, data=2), model_fn, x, y, 2, 8)
  _assert_same(model, losses, reference, reference_losses, 1e-6)
  # The router loss moves the weights well beyond that bound: the test
  # fails when its gradient is lost.
  without, _ = _fit(_data_parallel(), MixtralLanguageModel(0.0), x, y, 2, 8)
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
      reference.get_weights(), without.get_weights()))
  assert moved > 1e-3, moved


def test_model_built_on_a_backbones_output():
  # `keras.Model(backbone.input, head(backbone.output))`, the backbone
  # made in the scope too: ZeRO-3 sliced the backbone's weights when the
  # backbone was built, and until 2026-11-29 the outer model's optimizer
  # updated only its head's slices (GPT-2 ended 0.098 from one device, its
  # backbone's weights as initialized).
  reference, reference_losses = hub_common.reference("gpt2", "sgd")
  model, losses = hub_common.train("gpt2", "sgd", _zero3(None, data=2))
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  for got, want, weight in zip(model.get_weights(), reference.get_weights(),
                               model.weights):
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=weight.path)


class SubclassedMLP(keras.Model):
  """Keras's subclassing guide's style: layers made in __init__, built at
  their first call."""

  def __init__(self):
    super().__init__()
    self.hidden = [keras.layers.Dense(16, activation="relu"),
                   keras.layers.Dense(8)]
    self.out = keras.layers.Dense(1)

  def call(self, x):
    for layer in self.hidden:
      x = layer(x)
    return self.out(x)


def _subclassed(strategy, build):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  y = rng.normal(size=(64, 1)).astype("float32")
  with strategy.scope() if strategy else tf.init_scope():
    keras.utils.set_random_seed(5)
    model = SubclassedMLP()
    build(model, x)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  losses = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                     verbose=0).history["loss"]
  return model, losses


def test_subclassed_model_called_in_scope():
  called = lambda model, x: model(x[:1])
  reference, reference_losses = _subclassed(None, called)
  model, losses = _subclassed(_zero3(None), called)
  _assert_same(model, losses, reference, reference_losses, 1e-6)


@pytest.mark.parametrize("build", ["build_input_shape", "lazy"])
def test_subclassed_model_with_unbuilt_layers_is_refused(build):
  # Keras's Model.build(input_shape) marks the model built, not its
  # layers: they would create their weights inside the traced step (an
  # AttributeError inside tfpar before). A model left unbuilt is built by
  # Keras before its first step, with its optimizer: ZeRO-3 refuses it
  # (Keras's "Unknown variable" before), tensor parallelism lays it out
  # then (tests/test_tensor_parallel_plan.py).
  def builder(model, x):
    del x
    if build == "build_input_shape":
      model.build((None, 8))
  strategies = [_zero3(None)]
  if build == "build_input_shape":
    strategies.append(tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})))
  for strategy in strategies:
    with pytest.raises(ValueError, match=r"has layers that are not built: "
                       r"\['dense.*Call the model on a batch"):
      _subclassed(strategy, builder)
    assert strategy.extended.datasets_distributed == 0
