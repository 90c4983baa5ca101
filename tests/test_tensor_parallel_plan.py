"""ShardingPlan rules and the errors bad input gets before training."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
import tp_common


def _strategy(tensor=2):
  return tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": tensor}))


def _mlp_pair(hidden=16, name="mlp"):
  inputs = keras.Input((8,))
  x = keras.layers.Dense(hidden, activation="relu", name="up")(inputs)
  x = keras.layers.Dense(8, name="down")(x)
  return keras.Model(inputs, keras.layers.Dense(2, name="head")(x), name=name)


def _styles(plan, model, tensor=2):
  return {v.path: (v.style.name, v.axis)
          for layout in plan.resolve(model, tensor) for v in layout.variables}


def test_builtin_plan_finds_mlp_pairs_and_leaves_lone_dense_replicated():
  assert _styles(tfpar.ShardingPlan(), _mlp_pair()) == {
      "up/kernel": ("ColumnParallel", 1), "up/bias": ("ColumnParallel", 0),
      "down/kernel": ("RowParallel", 0), "down/bias": ("Replicate", None)}


def test_user_rules_override_and_extend_the_builtin_plan():
  plan = tfpar.ShardingPlan([(r"^head/kernel$", tfpar.ColumnParallel()),
                             (r"^up/", tfpar.Replicate())])
  styles = _styles(plan, _mlp_pair())
  assert styles["head/kernel"] == ("ColumnParallel", 1)
  assert styles["head/bias"] == ("ColumnParallel", 0)  # Follows its kernel.
  assert "up/kernel" not in styles  # Replicated: not a sharded layer.
  assert styles["down/kernel"] == ("RowParallel", 0)


def test_rules_only_plan_with_builtins_off():
  plan = tfpar.ShardingPlan([(r"down/kernel", tfpar.RowParallel())],
                            builtin=False)
  assert _styles(plan, _mlp_pair()) == {"down/kernel": ("RowParallel", 0),
                                        "down/bias": ("Replicate", None)}


def test_einsum_dense_rules_split_the_named_axes():
  inputs = keras.Input((4, 8))
  x = keras.layers.EinsumDense("abc,cd->abd", (4, 16), bias_axes="d",
                               name="expand")(inputs)
  model = keras.Model(inputs, keras.layers.EinsumDense(
      "abd,de->abe", (4, 8), name="contract")(x))
  plan = tfpar.ShardingPlan([(r"contract/kernel", tfpar.RowParallel())])
  assert _styles(plan, model) == {
      "expand/kernel": ("ColumnParallel", 1),
      "expand/bias": ("ColumnParallel", 0),
      "contract/kernel": ("RowParallel", 0)}


@pytest.mark.parametrize("rules, message", [
    ([(r"nothing_here", tfpar.ColumnParallel())],
     r"rule 0 'nothing_here' -> ColumnParallel matches no variable"),
    ([(r"up/kernel", tfpar.ColumnParallel()),
      (r"kernel", tfpar.Replicate())],
     r"'up/kernel' matches 2 ShardingPlan rules"),
    ([(r"up/bias", tfpar.ColumnParallel())],
     r"no rule covers 'up/kernel': a bias follows its kernel"),
    ([(r"up/kernel", tfpar.ColumnParallel()),
      (r"up/bias", tfpar.RowParallel())],
     r"'up/bias' the style RowParallel but its kernel is ColumnParallel"),
    ([(r"up/kernel", tfpar.VocabParallel())],
     r"VocabParallel applies to Embedding tables"),
    ([("(", tfpar.ColumnParallel())], r"is not a regular expression"),
    ([("up", "column")], r"needs a style instance"),
])
def test_bad_rules_are_value_errors(rules, message):
  with pytest.raises(ValueError, match=message):
    tfpar.ShardingPlan(rules).resolve(_mlp_pair(), 2)


def test_style_on_an_unshardable_layer_is_an_error():
  model = tp_common.gpt()
  plan = tfpar.ShardingPlan([(r"block0_ln1/gamma", tfpar.ColumnParallel())])
  with pytest.raises(ValueError, match=r"not a Dense, EinsumDense, Embedding "
                     r"or MultiHeadAttention layer"):
    plan.resolve(model, 2)


@pytest.mark.parametrize("build, message", [
    (lambda: _mlp_pair(hidden=6), r"'up': kernel axis 1 \(output features\) "
     r"= 6 is not divisible by the mesh's tensor size 4"),
    (lambda: tp_common.gpt(heads=2, width=16),
     r"'block0_attention': num_heads = 2 is not divisible by the mesh's "
     r"tensor size 4"),
    (lambda: tp_common.gpt(vocab=30),
     r"'tokens': input_dim \(vocabulary\) = 30 is not divisible by the "
     r"mesh's tensor size 4"),
])
def test_indivisible_dimensions_fail_when_the_model_is_sharded(build,
                                                               message):
  strategy = _strategy(tensor=4)
  with pytest.raises(ValueError, match=message):
    with strategy.scope():
      build().compile(optimizer="adam", loss="mse")


def test_model_built_by_fit_is_sharded_before_its_first_step():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
  x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
  model.fit(x, x[:, :2], batch_size=8, epochs=2, verbose=0)
  kernel = model.layers[0]._kernel  # pylint: disable=protected-access
  # One variable of the shard's shape, shard k on the k-th device; its
  # whole view is the ShardedWeight.
  assert tuple(kernel.shape) == (4, 4)
  assert [c.device for c in kernel.value.values] == [
      d for group in strategy.mesh.replicas for d in group]
  kernel = kernel._tfpar_shard_of[0]  # pylint: disable=protected-access
  assert isinstance(kernel, tfpar.ShardedWeight)
  assert tuple(kernel.shape) == (4, 8)
  plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
      8, activation="relu"), keras.layers.Dense(2)])
  plain.set_weights(list(tfpar.logical_weights(model).values()))
  np.testing.assert_allclose(model.predict(x, verbose=0),
                             plain.predict(x, verbose=0), atol=1e-6)


def test_model_first_built_inside_a_step_is_refused():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
  # Traced, as a step is (spmd=True runs no eager strategy.run).
  step = tf.function(lambda: strategy.run(
      lambda: model(tf.zeros((2, 4)))))
  with pytest.raises(ValueError, match=r"weights would stay replicated. "
                     r"Build it inside strategy.scope\(\) before"):
    step()


def test_bad_strategy_arguments():
  with pytest.raises(ValueError, match="pipeline=2"):
    tfpar.TensorParallelStrategy(tfpar.Mesh({"pipeline": 2, "tensor": 2}))
  with pytest.raises(ValueError, match="plan must be a tfpar.ShardingPlan"):
    tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 2}), plan="megatron")


def test_unbuilt_model_cannot_be_described():
  model = keras.Sequential([keras.layers.Dense(2)])
  with pytest.raises(ValueError, match="is not built"):
    tfpar.ShardingPlan().resolve(model, 2)
