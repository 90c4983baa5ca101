"""Sequence parallelism on keras-hub models under
TensorParallelStrategy(spmd=True, sequence_parallel=True).

keras-hub's blocks run their own call on each device's slice of the
sequence (tfpar/tensor_parallel/spmd/blocks.py): GPT-2 (position
embeddings, LayerNorms, biases) and Llama (rotary embeddings, RMS norms,
gated MLP; at tensor 4 its 2 key/value heads shared) train as one device
does, and each device moves, per step, the bytes of Megatron's
reduce-scatters and all-gathers: as many as the all-reduces they replace
in a ring. Mixed bfloat16 stays within stock MirroredStrategy's spread.
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
import tfpar
import tp_common

STEPS = 4
WIDTH = 16
CASES = [("gpt2", {"data": 2, "tensor": 2}),
         ("llama", {"data": 2, "tensor": 2}),
         ("llama", {"data": 1, "tensor": 4})]


def _model(family, **overrides):
  keras.utils.set_random_seed(1)
  config = dict(vocabulary_size=hub_common.VOCAB, num_layers=1,
                hidden_dim=WIDTH, intermediate_dim=32, **overrides)
  if family == "gpt2":
    backbone = keras_hub.models.GPT2Backbone(
        num_heads=4, max_sequence_length=hub_common.SEQUENCE, dropout=0.0,
        **config)
  else:
    backbone = keras_hub.models.LlamaBackbone(
        num_query_heads=4, num_key_value_heads=2, **config)
  # The tied output head: the token embedding reversed (a CausalLM's).
  return keras.Model(backbone.input,
                     backbone.token_embedding(backbone.output, reverse=True))


def _strategy(layout, **kwargs):
  devices = tf.config.list_logical_devices("CPU")[:layout["data"] *
                                                 layout["tensor"]]
  return tfpar.TensorParallelStrategy(
      tfpar.Mesh(layout, [d.name for d in devices]), spmd=True,
      sequence_parallel=True, **kwargs)


def _fit(family, strategy=None, policy="float32"):
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = _model(family)
      model.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
    x, y = hub_common.data(family, count=hub_common.BATCH * STEPS)
    return model, tp_common.step_losses(model, x, y, epochs=1)
  finally:
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="module")
def references():
  return {family: _fit(family) for family in ("gpt2", "llama")}


@pytest.fixture(scope="module")
def runs():
  done = {}

  def run(family, layout):
    key = (family, tuple(layout.items()))
    if key not in done:
      with tfpar.CommunicationLog() as log:
        model, losses = _fit(family, _strategy(layout))
      done[key] = (model, losses, log)
    return done[key]
  return run


class MlpBlock(keras.layers.Layer):
  """A residual MLP computed inside a layer of its own."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.up = keras.layers.Dense(32, activation="relu", name="up")
    self.down = keras.layers.Dense(WIDTH, name="down")

  def call(self, x):
    return x + self.down(self.up(x))


def _ids(case):
  family, layout = case
  return f"{family}-{layout['data']}x{layout['tensor']}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_trains_like_one_device(references, runs, case):
  family, layout = case
  reference, reference_losses = references[family]
  model, losses, _ = runs(family, layout)
  assert len(losses) == STEPS
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5, rtol=0)
  assert [w.path for w in model.weights] == [w.path for w in
                                              reference.weights]
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=_ids)
def test_each_device_moves_the_all_reduces_bytes_in_slices(runs, case):
  family, layout = case
  _, _, log = runs(family, layout)
  t = layout["tensor"]
  activation = (hub_common.BATCH // layout["data"] * hub_common.SEQUENCE *
                WIDTH * 4)
  # Megatron's g (token embedding, attention and MLP outputs) and f
  # (attention and MLP inputs, the tied head's input) of the one block.
  g = f = 3
  for replica in range(layout["data"]):
    per_device = {}
    for record in log.step_records(replica):
      assert not (record.kind == "all-reduce" and record.phase ==
                  "forward"), record  # Only weights' gradients are.
      # Sequence slices: gathers [sequence, batch, width], reduce-scatters
      # [t, batch, slice, width] (not the vocabulary's logits, nor shared
      # key/value heads' gradients).
      rank = {"all-gather": 3, "reduce-scatter": 4}.get(record.kind)
      if rank is None or record.tensor.shape.rank != rank or (
          record.tensor.shape[-1] != WIDTH):
        continue
      assert record.bytes == (t - 1) * activation // t, record
      kinds = per_device.setdefault(record.tensor.device, {})
      key = (record.kind, record.phase)
      kinds[key] = kinds.get(key, 0) + record.bytes
    assert len(per_device) == t
    for kinds in per_device.values():
      slice_bytes = (t - 1) * activation // t
      assert kinds == {("reduce-scatter", "forward"): g * slice_bytes,
                       ("all-gather", "backward"): g * slice_bytes,
                       ("all-gather", "forward"): f * slice_bytes,
                       ("reduce-scatter", "backward"): f * slice_bytes}
      # The ring's bytes of the g + f all-reduces they replace.
      assert sum(kinds.values()) == (g + f) * 2 * (t - 1) * activation // t


def test_mixed_bfloat16_within_mirrored_spread():
  policy = "mixed_bfloat16"
  measured = []
  for strategy in (None, stock_strategies.mirrored(tfpar.Mesh().devices[:2]),
                   _strategy({"data": 2, "tensor": 2})):
    model, losses = _fit("llama", strategy, policy)
    measured.append((losses, model.get_weights()))
  reference = measured[0]
  spread = precision_common.differences(*measured[1], *reference)
  got = precision_common.differences(*measured[2], *reference)
  assert got[2] <= 1e-6, got  # The first loss: one device's.
  precision_common.assert_within_spread(policy, True, got, spread,
                                        first_loss=reference[0][0])


def test_what_it_cannot_run_on_slices_raises_before_any_work():
  layout = {"data": 1, "tensor": 2}
  # Split layers inside a layer of the graph that is no keras-hub block.
  with pytest.raises(ValueError, match=r"'mlp_block' \(MlpBlock\).*"
                     r"sequence_parallel=False"):
    with _strategy(layout, plan=[(r"up/kernel", tfpar.ColumnParallel()),
                                 (r"down/kernel", tfpar.RowParallel())]
                   ).scope():
      inputs = keras.Input((hub_common.SEQUENCE, WIDTH))
      keras.Model(inputs, MlpBlock(name="mlp_block")(inputs))
  # A token embedding whose Keras mask would be the whole sequence's.
  with pytest.raises(ValueError, match=r"'tokens'.*mask_zero=True"):
    with _strategy(layout).scope():
      tokens = keras.Input((hub_common.SEQUENCE,), dtype="int32")
      embedding = keras_hub.layers.ReversibleEmbedding(
          hub_common.VOCAB, WIDTH, mask_zero=True, name="tokens")
      keras.Model(tokens, embedding(embedding(tokens), reverse=True))
