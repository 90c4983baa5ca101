"""Attention layers tfpar has no table entry for, found by tracing
(tfpar/tensor_parallel/attention_trace.py): keras-hub SmolLM3 (queries,
keys and values from Dense kernels reshaped into heads), Falcon (a
per-head alibi argument), Bloom (AlibiBias inside the layer) and GPT-NeoX
(a fused query-key-value kernel), Qwen3 (query and key norms on each
device's heads) and Gemma3 (a table entry: grouped scores) under data 2
x tensor 2 against one device, each attention split as Megatron splits
it; attention tracing cannot split is a ValueError."""

import keras
import keras_hub
import numpy as np
import pytest

import attention_common
import tfpar

VOCAB = 64
SEQUENCE = 8
M = keras_hub.models
# 1 block, hidden 32, 4 query heads (SmolLM3: 2 key/value heads).
FAMILIES = {
    "smollm3": (lambda: M.SmolLM3Backbone(
        vocabulary_size=VOCAB, hidden_dim=32, intermediate_dim=64,
        num_layers=1, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=False, attention_dropout=0.0,
        rope_layer_enabled_list=[True], layer_types=["attention"],
        mlp_bias=False, layer_norm_epsilon=1e-6, max_position_embeddings=32,
        rope_theta=10000.0, partial_rotary_factor=1.0),
                ("q_proj", "k_proj", "v_proj"), "o_proj"),
    # Query and key norms applied to each device's heads: their gradients
    # summed over the tensor group (found by tracing; Gemma3's by table).
    "qwen3": (lambda: M.Qwen3Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
        num_key_value_heads=2, head_dim=8, hidden_dim=32,
        intermediate_dim=64),
              ("query", "key", "value"), "attention_output"),
    "gemma3": (lambda: M.Gemma3Backbone(
        vocabulary_size=VOCAB, image_size=16, num_layers=1,
        num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64, head_dim=8, vision_encoder=None),
               ("query", "key", "value"), "attention_output"),
    "falcon": (lambda: M.FalconBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_attention_heads=4,
        hidden_dim=32, intermediate_dim=64),
               ("query_dense", "key_dense", "value_dense"), "output_dense"),
    "bloom": (lambda: M.BloomBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=32,
        intermediate_dim=64),
              ("query_dense", "key_dense", "value_dense"), "output_dense"),
    "gpt_neox": (lambda: M.GPTNeoXBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=32),
                 ("query_key_value",), "attention_output"),
}


def _language_model(family):
  backbone = FAMILIES[family][0]()
  logits = backbone.token_embedding(backbone.output, reverse=True)
  return keras.Model(backbone.input, logits)


def _data():
  rng = np.random.default_rng(0)
  count = attention_common.BATCH * attention_common.STEPS
  ids = rng.integers(1, VOCAB, size=(count, SEQUENCE + 1)).astype("int32")
  mask = np.ones((count, SEQUENCE), "int32")
  mask[:, -1] = rng.integers(0, 2, size=count)
  return {"token_ids": ids[:, :-1], "padding_mask": mask}, ids[:, 1:]


def _megatron_halves(weight):
  """Megatron's layout: every kernel and the token table halved; norms,
  biases and position tables whole."""
  return len(weight.shape) >= 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_traced_attention_splits_like_megatron_and_trains_like_one_device(
    family):
  x, y = _data()
  reference, model, worst, strategy = attention_common.compare(
      lambda: _language_model(family), x, y)
  assert worst < 1e-6, worst
  _, columns, row = FAMILIES[family]
  for weight in reference.weights:
    name = weight.path.split("/")[-2]
    if name in columns or (name == row and weight.path.endswith("kernel")):
      assert attention_common.halved_on_every_device(
          model, reference, weight.path, strategy), weight.path
  # The output projection is row-parallel: its bias whole on every device.
  layouts = {v.path: v for layout in model._tfpar_layouts  # pylint: disable=protected-access
             for v in layout.variables}
  output = [w.path for w in reference.weights
            if w.path.split("/")[-2] == row]
  assert {p: layouts[p].style.name for p in output} == {
      p: "RowParallel" if p.endswith("kernel") else "Replicate"
      for p in output}, output
  fullest, share = attention_common.fullest_and_megatron(
      model, reference, _megatron_halves)
  assert fullest <= share * 1.05, (fullest, share)
  total = sum(np.asarray(w).nbytes for w in reference.get_weights())
  print(f"| {family} | {worst:.1e} | {fullest:,} / {total:,} = "
        f"{fullest / total:.3f} | Megatron {share / total:.3f} |")


class _Heads(keras.layers.Layer):
  """Self-attention of stock Dense layers, its head count held as
  `num_heads` and, when `per_head_bias`, a learned-free per-head bias
  computed inside the call for all heads."""

  def __init__(self, num_heads, per_head_bias=False, extra=None, **kwargs):
    super().__init__(**kwargs)
    self.num_heads = num_heads
    self.per_head_bias = per_head_bias
    if extra is not None:
      self.other_heads = extra
    self.query = keras.layers.Dense(16, name="query")
    self.key = keras.layers.Dense(16, name="key")
    self.value = keras.layers.Dense(16, name="value")
    self.out = keras.layers.Dense(16, name="out")

  def call(self, x):
    split = lambda t: keras.ops.transpose(keras.ops.reshape(
        t, (-1, x.shape[1], self.num_heads, 16 // self.num_heads)),
                                          (0, 2, 1, 3))
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    scores = keras.ops.matmul(q, keras.ops.transpose(k, (0, 1, 3, 2)))
    if self.per_head_bias:
      slopes = keras.ops.arange(1, self.num_heads + 1, dtype="float32")
      scores = scores + keras.ops.reshape(slopes, (1, -1, 1, 1))
    out = keras.ops.matmul(keras.ops.softmax(scores), v)
    out = keras.ops.reshape(keras.ops.transpose(out, (0, 2, 1, 3)),
                            (-1, x.shape[1], 16))
    return self.out(out)


def test_attention_tracing_cannot_split_is_a_value_error():
  def model(**kwargs):
    x = keras.Input((4, 16))
    return keras.Model(x, _Heads(4, name="attention", **kwargs)(x))

  plan = tfpar.ShardingPlan()
  found = plan.resolve(model(), 2)
  styles = {v.path: v.style.name for layout in found
            for v in layout.variables}
  assert styles["attention/query/kernel"] == "ColumnParallel", styles
  assert styles["attention/out/kernel"] == "RowParallel", styles
  with pytest.raises(ValueError, match=r"per-head term .* inside the layer"):
    plan.resolve(model(per_head_bias=True), 2)
  with pytest.raises(ValueError, match=r"'other_heads' = 3 looks like a head"):
    plan.resolve(model(extra=3), 2)
  # A mask broadcast to the scores' shape (Keras's dot_product_attention,
  # ESM's attention) is the same for every head: split, not refused.
  esm = M.ESMBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=4,
                      hidden_dim=32, intermediate_dim=64, dropout=0.0)
  styles = {v.path: v.style.name for layout in plan.resolve(esm, 2)
            for v in layout.variables}
  assert styles["transformer_layer_0/attention_layer/q_dense_layer/kernel"] == (
      "ColumnParallel"), styles
  assert styles["transformer_layer_0/attention_layer/o_dense_layer/kernel"] == (
      "RowParallel"), styles
  # Rules for its weights decide instead: replicated, no error.
  replicated = tfpar.ShardingPlan([(r"attention/", tfpar.Replicate())])
  assert not replicated.resolve(model(per_head_bias=True), 2)


def test_traced_attention_generates_one_devices_tokens():
  """keras-hub's generate on traced attention: SmolLM3 (its cache argument
  named `self_attention_cache`) and Falcon (its alibi argument over all
  heads, each device taking its heads') give one device's greedy tokens
  under data 2 x tensor 2."""
  prompt = {"token_ids": np.array([[5, 6, 7, 0, 0, 0, 0, 0]] * 2, "int32"),
            "padding_mask": np.array([[1, 1, 1, 0, 0, 0, 0, 0]] * 2,
                                     "int32")}
  tasks = {"smollm3": M.SmolLM3CausalLM, "falcon": M.FalconCausalLM}
  for family, task in tasks.items():
    def build():
      keras.utils.set_random_seed(1)
      causal_lm = task(backbone=FAMILIES[family][0](), preprocessor=None)
      causal_lm.compile(sampler="greedy")
      return causal_lm

    expected = build().generate(prompt, max_length=SEQUENCE,
                                stop_token_ids=None)
    strategy = tfpar.TensorParallelStrategy(
        tfpar.Mesh(attention_common.LAYOUT))
    with strategy.scope():
      causal_lm = build()
    assert any(layout.kind == "AttentionHeads" for layout in
               causal_lm._tfpar_layouts), family  # pylint: disable=protected-access
    got = causal_lm.generate(prompt, max_length=SEQUENCE, stop_token_ids=None)
    np.testing.assert_array_equal(got["token_ids"], expected["token_ids"],
                                  err_msg=family)
