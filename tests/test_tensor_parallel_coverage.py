"""What the built-in plan refuses to do silently: large weights left whole,
layers it cannot split, head counts that do not divide."""

import keras
import keras_hub
import pytest

import tfpar


def _strategy(tensor=2):
  return tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 4 // tensor, "tensor": tensor}))


def _wide_head_model():
  """An MLP pair (split) under a lone Dense 4x larger (replicated)."""
  inputs = keras.Input((16,))
  x = keras.layers.Dense(32, activation="relu", name="up")(inputs)
  x = keras.layers.Dense(16, name="down")(x)
  return keras.Model(inputs, keras.layers.Dense(128, name="wide")(x))


def test_large_replicated_weight_is_an_error_naming_the_rule():
  with pytest.raises(ValueError, match=(
      r"Weight 'wide/kernel' .*2,048 parameters.* larger than every weight "
      r"the plan splits \(512\).*ShardingPlan\(\[\('wide/kernel', "
      r"tfpar.Replicate\(\)\)\]\)")):
    with _strategy().scope():
      _wide_head_model()


def test_replicate_rule_accepts_it_and_describe_lists_it():
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}),
      plan=[("wide/kernel", tfpar.Replicate())])
  with strategy.scope():
    model = _wide_head_model()
  lines = strategy.describe(model, print_fn=None).splitlines()
  assert lines[-4] == ("split over the tensor axis: 32.5% of the parameters "
                       "(1,056 of 3,248)")
  assert lines[-3].startswith("replicated (3): wide/kernel (2,048), "
                              "wide/bias (128)")


def test_lora_factors_split_with_their_kernel():
  inputs = keras.Input((16,))
  up = keras.layers.Dense(64, activation="relu", name="up")
  down = keras.layers.Dense(16, name="down")
  model = keras.Model(inputs, down(up(inputs)))
  up.enable_lora(2)
  down.enable_lora(2)
  axes = {v.path: v.axis for layout in tfpar.ShardingPlan().resolve(model, 2)
          for v in layout.variables}
  # Column-parallel: `b` split on the outputs; row-parallel: `a` on the
  # inputs; the other factor whole.
  assert axes == {"up/kernel": 1, "up/bias": 0, "up/lora_kernel_a": None,
                  "up/lora_kernel_b": 1, "down/kernel": 0, "down/bias": None,
                  "down/lora_kernel_a": 0, "down/lora_kernel_b": None}


def test_float8_dense_is_a_value_error_naming_the_mode():
  inputs = keras.Input((16,))
  up = keras.layers.Dense(64, activation="relu", name="up")
  model = keras.Model(inputs, keras.layers.Dense(16, name="down")(up(inputs)))
  model.quantize("float8")
  with pytest.raises(ValueError, match=(
      r"Layer 'up' \(Dense\) is quantized with quantization_mode='float8'"
      r".*splits quantized kernels of mode 'int8' only")):
    tfpar.ShardingPlan().resolve(model, 2)


def test_style_on_a_layer_tfpar_cannot_split_names_its_class():
  inputs = keras.Input((8, 16))
  x = keras.layers.Conv1D(16, 3, name="conv")(inputs)
  model = keras.Model(inputs, x)
  plan = tfpar.ShardingPlan([("conv/kernel", tfpar.ColumnParallel())])
  with pytest.raises(ValueError, match=r"layer 'conv' \(Conv1D\)"):
    plan.resolve(model, 2)


def test_key_value_heads_that_neither_split_nor_share_are_refused():
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=64, num_layers=1, num_query_heads=12,
      num_key_value_heads=3, hidden_dim=48, intermediate_dim=192)
  with pytest.raises(ValueError, match=(
      r"\(LlamaAttention\): 3 key/value heads can be neither split over nor "
      r"replicated within the mesh's tensor size 2")):
    tfpar.ShardingPlan().resolve(backbone, 2)


def test_query_heads_not_divisible_are_refused():
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=64, num_layers=1, num_heads=3, hidden_dim=48,
      intermediate_dim=192, max_sequence_length=16)
  with pytest.raises(ValueError, match=(
      r"\(CachedMultiHeadAttention\): 3 query heads are not divisible by "
      r"the mesh's tensor size 2")):
    tfpar.ShardingPlan().resolve(backbone, 2)
