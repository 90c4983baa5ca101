"""Weight regularizers and constraints of split weights: each tensor shard
carries its weight's (an L2 kernel regularizer used to be dropped, training
silently without it), and what cannot be applied piece by piece is a
ValueError before training."""

import keras
import numpy as np
import pytest

import pp_common
import tfpar


def _tensor2():
  return tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2, "tensor": 2}))


def test_regularized_model_trains_like_one_device():
  # pp_common's chain: an L2 kernel regularizer on a split layer, and
  # activity regularizers.
  reference, result = pp_common.one_device(), pp_common.train(_tensor2())
  pp_common.assert_same_training(reference, result)
  # The layers' regularizers serialize as the user gave them.
  model, plain = result[4], reference[4]
  for name in ("embed", "block0_in"):
    assert model.get_layer(name).get_config() == (
        plain.get_layer(name).get_config())


def test_spmd_refuses_activity_terms_of_split_outputs():
  """Under spmd a paired column-parallel layer's output stays split: its
  activity regularizer must be a sum over elements."""
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}), spmd=True)
  with pytest.raises(ValueError, match=(
      "'up' has its output split .* activity_regularizer "
      "_LargestValue is not a sum over elements")):
    with strategy.scope():
      _pair(first={"activity_regularizer": _LargestValue()})


class _LargestValue(keras.regularizers.Regularizer):
  """A term of the whole tensor: its largest absolute value."""

  def __call__(self, x):
    return keras.ops.max(keras.ops.abs(x))


def _pair(first=None, second=None):
  """Dense 8 -> 16 (column-split) -> 8 (row-split) -> 1 with the given
  (kernel_regularizer, kernel_constraint) of the first and second layers."""
  first, second = first or {}, second or {}
  inputs = keras.Input((8,))
  x = keras.layers.Dense(16, activation="relu", name="up", **first)(inputs)
  x = keras.layers.Dense(8, name="down", **second)(x)
  return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def _fit(strategy, **kwargs):
  keras.utils.set_random_seed(3)
  with strategy.scope() if strategy else keras.name_scope("one"):
    model = _pair(**kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  y = x[:, :1] * x[:, 1:2]
  history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      verbose=0)
  return np.array(history.history["loss"]), model.get_weights()


def test_constraints_of_split_weights_are_applied():
  terms = dict(first={"kernel_constraint": keras.constraints.NonNeg()},
               second={"kernel_constraint": keras.constraints.MaxNorm(
                   0.5, axis=1)})  # Row-split along 0: norms along 1.
  losses, weights = _fit(_tensor2(), **terms)
  ref_losses, ref_weights = _fit(None, **terms)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for ours, theirs in zip(weights, ref_weights):
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
  assert weights[0].min() >= 0.0  # NonNeg held on every shard.


@pytest.mark.parametrize("terms,message", [
    (dict(first={"kernel_regularizer":
                 keras.regularizers.OrthogonalRegularizer()}),
     "'up/kernel' .* OrthogonalRegularizer is not a sum over elements"),
    (dict(second={"kernel_constraint": keras.constraints.MaxNorm(2.0)}),
     "'down/kernel' .* axis 0, but its constraint MaxNorm"),
])
def test_terms_that_need_the_whole_weight_are_errors(terms, message):
  with pytest.raises(ValueError, match=message):
    with _tensor2().scope():
      _pair(**terms)
