"""Dropout under TensorParallelStrategy(spmd=True) draws its data
replica's masks.

Each device draws the mask its data replica draws for the whole tensor
(the same SeedGenerator state, all heads, the whole sequence) and keeps
its part, so a model with dropout > 0 trains exactly as one device (data
1) or stock MirroredStrategy on `data` CPUs (whose replicas draw their own
batch's masks from the same seed state, as tfpar's data axis does): every
step's loss, every weight and every seed generator's state (on every
device) are compared with the same model and seeds fitted there. Without
the slicing (each device drawing for its own part's shape: masks repeat
across heads and slices) the losses of these cases move by 3e-3 to 7e-2
and the weights by about 6e-2, far beyond the 1e-5 tolerance.
"""

import contextlib

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import stock_strategies
import tfpar
import tp_common
from tfpar.tensor_parallel.spmd import dropout as dropout_lib

STEPS = 3
RATE = 0.3


def _gpt(seed=1):
  """tp_common's one-block GPT shape, with attention dropout and Dropout
  layers on the embeddings, the attention and the MLP outputs."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((tp_common.SEQUENCE,), dtype="int32")
  x = keras.layers.Embedding(tp_common.VOCAB, 16, name="tokens")(tokens)
  x = keras.layers.Dropout(RATE, name="embedding_dropout")(x)
  h = keras.layers.LayerNormalization(name="ln1")(x)
  h = keras.layers.MultiHeadAttention(
      4, 4, dropout=RATE, use_bias=False, name="attention")(
          h, h, use_causal_mask=True)
  x = x + keras.layers.Dropout(RATE, name="attention_dropout")(h)
  h = keras.layers.LayerNormalization(name="ln2")(x)
  h = keras.layers.Dense(32, activation="gelu", name="mlp_in")(h)
  h = keras.layers.Dense(16, name="mlp_out")(h)
  x = x + keras.layers.Dropout(RATE, noise_shape=(None, 1, 16),
                               name="mlp_dropout")(h)
  logits = keras.layers.Dense(tp_common.VOCAB, name="lm_head")(x)
  return keras.Model(tokens, logits, name="gpt")


def _strategy(layout, **kwargs):
  devices = tf.config.list_logical_devices("CPU")[:layout["data"] *
                                                 layout["tensor"]]
  return tfpar.TensorParallelStrategy(
      tfpar.Mesh(layout, [d.name for d in devices]), spmd=True, **kwargs)


def _seed_states(model):
  """[its seed generator's state on each device] per Dropout layer, in
  the model's layer order (attention's own Dropout has a generated
  name)."""
  found = []
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    generator = getattr(layer, "seed_generator", None)
    if generator is not None:
      value = generator.state.value
      found.append([np.asarray(v)
                    for v in getattr(value, "values", (value,))])
  return found


def _fit(build, data, strategy=None):
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  losses = tp_common.step_losses(model, *data, epochs=1)
  return model, losses


def _reference_strategy(layout):
  """Where an SPMD layout's masks are drawn as: one device (data 1), or
  stock MirroredStrategy on `data` CPUs."""
  if layout["data"] == 1:
    return None
  return stock_strategies.mirrored(tfpar.Mesh().devices[:layout["data"]])


def _assert_like_reference(build, data, layout, **kwargs):
  reference, reference_losses = _fit(build, data,
                                     _reference_strategy(layout))
  model, losses = _fit(build, data, _strategy(layout, **kwargs))
  assert len(losses) == len(data[1]) // tp_common.BATCH
  tp_common.assert_trains_like(model, losses, reference, reference_losses)
  want, got = _seed_states(reference), _seed_states(model)
  assert len(got) == len(want) > 0
  for (state, *others), components in zip(want, got):
    for other in others:  # Mirrored's replicas: one state.
      np.testing.assert_array_equal(other, state)
    assert state[1] == len(losses)  # One draw per step.
    for component in components:  # Every device's: one device's state.
      np.testing.assert_array_equal(component, state)
  return losses, reference_losses


def _gpt_data():
  return tp_common.data("gpt", count=tp_common.BATCH * STEPS)


@pytest.mark.parametrize("layout,sequence_parallel", [
    ({"data": 2, "tensor": 2}, False),
    ({"data": 1, "tensor": 4}, False),
    ({"data": 2, "tensor": 2}, True)], ids=["2x2", "1x4", "2x2-sequence"])
def test_gpt_with_dropout_trains_like_its_reference(layout,
                                                    sequence_parallel):
  _assert_like_reference(_gpt, _gpt_data(), layout,
                         sequence_parallel=sequence_parallel)


def _llama(seed=1):
  """A one-block Llama (4 query, 2 key/value heads) with dropout, and the
  tied output head; random init."""
  keras.utils.set_random_seed(seed)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=hub_common.VOCAB, num_layers=1, hidden_dim=16,
      intermediate_dim=32, num_query_heads=4, num_key_value_heads=2,
      dropout=RATE)
  return keras.Model(backbone.input,
                     backbone.token_embedding(backbone.output, reverse=True))


def test_keras_hub_llama_with_dropout_trains_like_mirrored():
  # data 2 x tensor 2: each device keeps its query heads ([batch,
  # sequence, heads, dim] after attention) of its replica's mask.
  _assert_like_reference(_llama, hub_common.data(
      "llama", count=tp_common.BATCH * STEPS), {"data": 2, "tensor": 2})


@pytest.mark.parametrize("local_shape,splits", [
    # Gemma's [batch, key/value heads, groups, t, s]: its 2 key/value heads
    # split over 2 devices (parts of the merged heads), with a second split
    # (the batch in 2 parts) to check that splits compose.
    ((2, 1, 2, 3, 3), [((0,), None, 2), ((1, 2), (2, 2), 2)]),
    # ... shared: 4 devices with one query head each.
    ((4, 1, 1, 3, 3), [((1, 2), (2, 2), 4)]),
])
def test_parts_of_the_mask_are_one_devices_mask(local_shape, splits):
  x = tf.random.stateless_normal((4, 2, 2, 3, 3), seed=(1, 2))
  want = keras.random.dropout(x, RATE, seed=keras.random.SeedGenerator(5))
  counts = [parts for _, _, parts in splits]
  for index in np.ndindex(*counts):
    part, expected = x, want
    for (axes, _, parts), i in zip(splits, index):
      part, expected = (_piece(v, axes, parts, i) for v in (part, expected))
    got = dropout_lib.one_device_dropout(
        tf.reshape(part, local_shape), RATE, None,
        keras.random.SeedGenerator(5),
        [(axes, sizes, parts, i)
         for (axes, sizes, parts), i in zip(splits, index)])
    np.testing.assert_array_equal(got, tf.reshape(expected, local_shape))


def _piece(x, axes, parts, index):
  shape = list(x.shape)
  merged = shape[:axes[0]] + [-1] + shape[axes[-1] + 1:]
  return tf.split(tf.reshape(x, merged), parts, axis=axes[0])[index]


def test_noise_shape_on_a_split_axis_and_unknown_attention_dropout_raise():
  # Sequence parallelism splits axis 1: a mask fixed to 8 there is not one
  # a device could draw for its slice. (Axis 0 is free: data replicas
  # draw their own batch's masks.)
  with pytest.raises(ValueError, match=r"noise_shape=\(None, 8, 16\)"):
    with _strategy({"data": 2, "tensor": 2}, sequence_parallel=True).scope():
      inputs = keras.Input((8, 16))
      keras.Model(inputs, keras.layers.Dropout(
          0.2, noise_shape=(None, 8, 16))(keras.layers.Dense(16)(inputs)))

  class Attention(keras.layers.MultiHeadAttention):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.extra = keras.layers.Dropout(0.1, name="extra")

  with pytest.raises(ValueError, match="'extra' \\(rate=0.1\\)"):
    with _strategy({"data": 1, "tensor": 2}).scope():
      inputs = keras.Input((8, 16))
      keras.Model(inputs, Attention(2, 8)(inputs, inputs))
