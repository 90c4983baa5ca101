"""PipelineParallelStrategy on keras-hub task models, which call their
backbone (a Functional model) as one layer: the backbone is inlined, so
stages start and end between its blocks, and a plan no cut can balance
warns."""

import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import tfpar
from tfpar.pipeline import stages as stages_lib

BLOCKS = 4
STEPS = 6


def _llama_causal_lm():
  keras.utils.set_random_seed(3)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=hub_common.VOCAB, num_layers=BLOCKS, hidden_dim=32,
      intermediate_dim=64, num_query_heads=4, num_key_value_heads=2)
  return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _bert_classifier():
  keras.utils.set_random_seed(4)
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=hub_common.VOCAB, num_layers=2, num_heads=2,
      hidden_dim=16, intermediate_dim=32, max_sequence_length=16,
      dropout=0.0)
  return keras_hub.models.BertTextClassifier(
      backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)


def _fit(build, x, y, optimizer, strategy=None):
  """(model, warnings) after STEPS steps of `fit` with `optimizer()` (made
  in the strategy's scope)."""
  scope = strategy.scope() if strategy else tf.init_scope()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with scope:
      model = build()
      model.compile(optimizer=optimizer(),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
    model.fit(x, y, batch_size=hub_common.BATCH, shuffle=False, verbose=0)
  return model, [str(w.message) for w in caught]


def _adam():
  return keras.optimizers.Adam(0.01)


def _sgd():
  return keras.optimizers.SGD(0.1)


def _strategy():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # m < p warns.
    return tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2)


def _max_difference(model, reference):
  assert [w.path for w in model.weights] == [
      w.path for w in reference.weights]
  return max(np.abs(a - b).max()
             for a, b in zip(model.get_weights(), reference.get_weights()))


@pytest.fixture(scope="module")
def llama_runs():
  x, y = hub_common.data("llama", count=hub_common.BATCH * STEPS)
  reference, _ = _fit(_llama_causal_lm, x, y, _adam)
  strategy = _strategy()
  model, caught = _fit(_llama_causal_lm, x, y, _adam,
                       strategy)
  return reference, model, strategy, caught


def test_llama_causal_lm_trains_as_on_one_device(llama_runs):
  reference, model, _, caught = llama_runs
  difference = _max_difference(model, reference)
  print(f"\nMEASURED LlamaCausalLM data 2 x pipeline 2, 1F1B, Adam, "
        f"{STEPS} steps: largest weight difference {difference:.1e}")
  assert difference < 1e-5
  assert not [m for m in caught if "unbalanced" in m], caught


def test_llama_blocks_split_two_and_two_with_half_the_bytes_each(
    llama_runs):
  reference, model, strategy, _ = llama_runs
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  names = [[l.name for l in stage.layers] for stage in plan.stages]
  assert names[0][-2:] == ["transformer_layer_0", "transformer_layer_1"]
  assert names[1][:2] == ["transformer_layer_2", "transformer_layer_3"]
  # Every variable's device and size, read from the per-device variables.
  devices = [tf.DeviceSpec.from_string(d).to_string()
             for d in strategy.mesh.devices]  # replica r, stage s: 2 r + s.
  found = hub_common.bytes_by_device(model)
  assert set(found) == set(devices)
  assert found[devices[0]] == found[devices[2]]  # Replicas hold the same.
  assert found[devices[1]] == found[devices[3]]
  whole = sum(w.nbytes for w in reference.get_weights())
  assert found[devices[0]] + found[devices[1]] == whole
  shares = [found[devices[s]] / whole for s in range(2)]
  print(f"\nMEASURED LlamaCausalLM bytes per stage device {shares[0]:.3f} / "
        f"{shares[1]:.3f} of the model ({whole} bytes)")
  assert all(0.4 < share < 0.6 for share in shares), shares
  for block in range(BLOCKS):
    on = hub_common.bytes_by_device(model, f"transformer_layer_{block}/")
    stage = block // 2
    assert set(on) == {devices[stage], devices[2 + stage]}, (block, on)


def _bytes_per_device(model):
  """{device: bytes of the model's variables held there}, counted from
  every component of every variable the trainer updates."""
  held = {}
  for variable in model.trainable_variables:
    value = variable.value
    for component in getattr(value, "values", (value,)):
      held[component.device] = held.get(component.device, 0) + (
          component.shape.num_elements() * component.dtype.size)
  return held


def test_llama_causal_lm_under_pipeline_and_tensor_trains_as_one_device():
  # 3D on a task model: its backbone, a model of its own created in the
  # same scope, is cut and split as part of the task model (before, it
  # was split alone first, and the task model's plan then traced its split
  # layers outside the replicas: a ValueError before any step).
  x, y = hub_common.data("llama", count=hub_common.BATCH * 2)
  reference, _ = _fit(_llama_causal_lm, x, y, _sgd)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # m < p warns.
    strategy = tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 1, "pipeline": 2, "tensor": 2}),
        num_microbatches=2)
  model, _ = _fit(_llama_causal_lm, x, y, _sgd, strategy)
  difference = _max_difference(model, reference)
  assert difference < 1e-5, difference
  # Every device holds its stage's shards: under half of one device's
  # trainable bytes on each of the 4 (a quarter of the split weights
  # and its stage's replicated norms; the tied table on both stages).
  whole = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
              for w in reference.trainable_variables)
  shares = sorted(b / whole for b in _bytes_per_device(model).values())
  assert len(shares) == 4 and shares[-1] < 0.45, shares
  print(f"\nMEASURED LlamaCausalLM pipeline 2 x tensor 2, SGD: weights "
        f"{difference:.1e} from one device; bytes per device / one "
        f"device's: {', '.join(f'{s:.3f}' for s in shares)}")


def test_bert_text_classifier_is_cut_between_blocks_and_trains_as_one():
  rng = np.random.default_rng(5)
  x, _ = hub_common.data("bert", count=hub_common.BATCH * STEPS)
  y = rng.integers(0, 3, size=len(x["token_ids"])).astype("int32")
  reference, _ = _fit(_bert_classifier, x, y, _sgd)
  strategy = _strategy()
  model, caught = _fit(_bert_classifier, x, y, _sgd,
                       strategy)
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  assert plan.stages[0].layers[-1].name == "transformer_layer_0"
  assert plan.stages[1].layers[0].name == "transformer_layer_1"
  assert not [m for m in caught if "unbalanced" in m], caught
  difference = _max_difference(model, reference)
  print(f"\nMEASURED BertTextClassifier data 2 x pipeline 2, SGD, {STEPS} "
        f"steps: largest weight difference {difference:.1e}, balance "
        f"{plan.imbalance:.2f}")
  assert difference < 1e-5


def test_stages_name_layers_inside_the_backbone():
  model = _llama_causal_lm()
  plan = stages_lib.plan_stages(model, 2, stages=["transformer_layer_3"])
  assert plan.stages[1].layers[0].name == "transformer_layer_3"
  assert model.backbone.get_layer("transformer_layer_2") in (
      plan.stages[0].layers)
  # The backbone is no stage's layer: its layers are.
  name = model.backbone.name
  with pytest.raises(ValueError, match=rf"stages names layer '{name}'"
                     r".*Its layers: .*transformer_layer_0"):
    stages_lib.plan_stages(model, 2, stages=[name])


def _bert_masked_lm():
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=hub_common.VOCAB, num_layers=2, num_heads=2,
      hidden_dim=16, intermediate_dim=32, max_sequence_length=16)
  return keras_hub.models.BertMaskedLM(backbone=backbone, preprocessor=None)


def _gpt2_causal_lm():
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=hub_common.VOCAB, num_layers=2, num_heads=2,
      hidden_dim=16, intermediate_dim=32, max_sequence_length=16)
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.parametrize("build", [_bert_masked_lm, _gpt2_causal_lm])
def test_other_task_models_are_cut_between_blocks(build):
  keras.utils.set_random_seed(6)
  plan = stages_lib.plan_stages(build(), 2)
  assert plan.stages[0].layers[-1].name == "transformer_layer_0"
  assert plan.stages[1].layers[0].name == "transformer_layer_1"
  assert plan.imbalance < 1.2, plan.describe()


class _Tower(keras.Model):
  """A subclassed model: its call() is code, so it stays one node."""

  def __init__(self):
    super().__init__(name="tower")
    self.wide = [keras.layers.Dense(256, activation="relu", name=f"wide{i}")
                 for i in range(2)]
    self.narrow = keras.layers.Dense(8, name="narrow")

  def call(self, x):
    for layer in self.wide:
      x = layer(x)
    return self.narrow(x)


def test_one_huge_layer_warns_naming_the_stage_its_share_and_the_layer():
  inputs = keras.Input((8,))
  x = keras.layers.Dense(8, name="first")(inputs)
  x = _Tower()(x)
  x = keras.layers.Dense(8, name="second")(x)
  outputs = keras.layers.Dense(8, name="last")(x)
  model = keras.Model(inputs, outputs, name="towering")
  with pytest.warns(UserWarning) as caught:
    plan = stages_lib.plan_stages(model, 2)
  message = str(caught[0].message)
  share = max(s.cost for s in plan.stages) / sum(s.cost for s in plan.stages)
  assert share > 0.95
  stage = next(s.index for s in plan.stages if
               any(l.name == "tower" for l in plan.stages[s.index].layers))
  assert (f"Pipeline stages of model 'towering' are unbalanced: stage "
          f"{stage} of 2 holds {share:.0%} of the estimated cost, where an "
          f"even split gives 50%") in message
  assert "Its layer 'tower' (_Tower) alone holds" in message
  # A balanced model does not warn.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    stages_lib.plan_stages(keras.Sequential(
        [keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(4)]), 2)


def test_a_nested_layer_named_as_an_outer_one_stays_one_node_and_warns():
  inner_input = keras.Input((8,))
  x = inner_input
  for i in range(3):
    x = keras.layers.Dense(8, name=f"inner{i}")(x)
  inner = keras.Model(inner_input, keras.layers.Dense(8, name="head")(x),
                      name="inner")
  inputs = keras.Input((8,))
  outputs = keras.layers.Dense(8, name="head")(inner(inputs))
  model = keras.Model(inputs, outputs, name="clash")
  with pytest.warns(UserWarning, match=r"Nested model\(s\) inner cannot be "
                    r"inlined into 'clash'.*name \"head\" is used 2 times"):
    plan = stages_lib.plan_stages(model, 2)
  assert [l.name for l in plan.stages[0].layers] == ["inner"]


def _chain(name, width, middle=None):
  """Input -> Dense -> (middle) -> Dense, a Functional model."""
  inputs = keras.Input((width,), name=f"{name}_input")
  x = keras.layers.Dense(width, activation="tanh", name=f"{name}0")(inputs)
  if middle is not None:
    x = middle(x)
  outputs = keras.layers.Dense(width, activation="tanh", name=f"{name}1")(x)
  return keras.Model(inputs, outputs, name=name)


def test_models_nested_twice_on_new_inputs_are_cut_inside_and_compute_alike():
  keras.utils.set_random_seed(7)
  model = _chain("outer", 8, _chain("middle", 8, _chain("inner", 8)))
  plan = stages_lib.plan_stages(model, 2)
  assert [[l.name for l in s.layers] for s in plan.stages] == [
      ["outer0", "middle0", "inner0"], ["inner1", "middle1", "outer1"]]
  x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
  first, last = (stage.model for stage in plan.stages)
  np.testing.assert_array_equal(last(first(x)), model(x))


def test_a_sequential_under_pipeline_and_tensor_trains_as_one_device():
  # Keras makes a Sequential's Functional graph in the scope too: it is
  # cut and split as the Sequential's (it was split alone first, and the
  # Sequential's plan then traced its split layers outside the replicas).
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 8)).astype("float32")

  def build():
    return keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(width, name=name)
        for width, name in ((16, "a"), (8, "b"), (16, "c"), (8, "d"))])

  weights = []
  for strategy in (None, tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2)):
    keras.utils.set_random_seed(3)
    with strategy.scope() if strategy else tf.init_scope():
      model = build()
      model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, x, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights.append(model.get_weights())
  rows = strategy.describe(model, print_fn=None).splitlines()
  assert "ColumnParallel" in [r for r in rows if "/a/kernel" in r][0]
  assert max(np.abs(a - b).max() for a, b in zip(*weights)) < 1e-5
