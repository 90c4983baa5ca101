"""Every keras-hub MoE family under expert parallelism, against one device.

Mixtral, Qwen-MoE, Qwen3-MoE, GPT-OSS (clamped SwiGLU experts with biases,
a router with bias taking the softmax over its top-k logits) and
Qwen3.5-MoE (text-only, its GatedDeltaNet linear-attention layer, shared
expert), tiny configs (hidden 16, 4 experts, top-2, vocabulary 64,
random init), 3 `fit` steps of SGD with momentum. Each family's model is
trained once per layout (module-scoped) and checked several ways: losses
and whole weights against one device, and the bytes of expert weights
(and their momentum) on each device, counted from every TensorFlow
variable as it is constructed and released (tests/variable_accounting.py),
not from tfpar's bookkeeping. Mixtral and Qwen-MoE under expert x tensor
are trained (once) in tests/test_expert_tensor_parallel.py.
"""

import re

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.expert_parallel import expert_bank
from tfpar.expert_parallel import families
from tfpar.expert_parallel import moe_block
from variable_accounting import VariableAccounting

VOCAB, SEQUENCE, BATCH, STEPS = 64, 8, 8, 3
HIDDEN, EXPERTS, TOP_K = 16, 4, 2
_SMALL = dict(vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=2,
              hidden_dim=HIDDEN, num_experts=EXPERTS, top_k=TOP_K)

BACKBONES = {
    "mixtral": lambda: keras_hub.models.MixtralBackbone(
        num_layers=1, intermediate_dim=16, **_SMALL),
    "qwen_moe": lambda: keras_hub.models.QwenMoeBackbone(
        num_layers=1, intermediate_dim=16, moe_intermediate_dim=16,
        shared_expert_intermediate_dim=16, router_aux_loss_coefficient=0.02,
        **_SMALL),
    "qwen3_moe": lambda: keras_hub.models.Qwen3MoeBackbone(
        num_layers=1, intermediate_dim=16, moe_intermediate_dim=16,
        head_dim=8, router_aux_loss_coefficient=0.02, **_SMALL),
    "gpt_oss": lambda: keras_hub.models.GptOssBackbone(
        num_layers=1, intermediate_dim=16, head_dim=8, **_SMALL),
    "qwen3_5_moe": lambda: keras_hub.models.Qwen3_5MoeBackbone(
        num_layers=1, head_dim=8, moe_intermediate_dim=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
        router_aux_loss_coefficient=0.02, **_SMALL),
}
# Expert x tensor (data 2 x tensor 2, expert 2): every family (Mixtral and
# Qwen-MoE in tests/test_expert_tensor_parallel.py, which checks the same
# and more on 2-layer models, so they are not trained twice), the other
# layers by tensor parallelism's built-in plan, but for GPT-OSS, whose
# attention (per-head sinks) tensor parallelism refuses: a plan rule
# replicates it. Qwen3.5-MoE's linear-attention layer is neither attention
# nor an MLP to the built-in plan, which keeps it whole.
EXPERT_TENSOR_PLANS = {
    "gpt_oss": lambda: tfpar.ShardingPlan(
        [(r".*self_attention/.*", tfpar.Replicate())]),
}
# The styles tensor parallelism gives the other layers: {family: {path
# pattern: style}} (Mixtral's and Qwen-MoE's in
# tests/test_expert_tensor_parallel.py), so that a test equal to one device
# is not one of layers left whole. Qwen3-MoE's query/key norms act on split heads.
EXPERT_TENSOR_STYLES = {
    "qwen3_moe": {r"self_attention/(query|key)/kernel": "ColumnParallel"},
    "gpt_oss": {r"self_attention/query/kernel": "Replicate"},
    "qwen3_5_moe": {r"linear_attn/in_proj_qkv/kernel": "Replicate",
                    r"shared_expert/feedforward_output_dense/kernel":
                        "RowParallel"},
}
# The expert layout each family trains under on data 4 (both sizes covered).
EXPERT = {"mixtral": 4, "qwen_moe": 2, "qwen3_moe": 4, "gpt_oss": 2,
          "qwen3_5_moe": 4}


def language_model(family):
  keras.utils.set_random_seed(1)
  backbone = BACKBONES[family]()
  logits = backbone.token_embedding(backbone.output, reverse=True)
  return keras.Model(backbone.input, logits, name=f"{family}_lm")


def dataset():
  rng = np.random.default_rng(0)
  ids = rng.integers(1, VOCAB, size=(BATCH * STEPS, SEQUENCE + 1)).astype(
      "int32")
  mask = np.ones((BATCH * STEPS, SEQUENCE), "int32")
  mask[:, -2:] = rng.integers(0, 2, size=(BATCH * STEPS, 2))
  inputs = {"token_ids": ids[:, :-1], "padding_mask": mask}
  return tf.data.Dataset.from_tensor_slices((inputs, ids[:, 1:])).batch(
      BATCH, drop_remainder=True)


def train(family, strategy=None):
  """(model, per-step losses) after STEPS steps of `fit`."""
  scope = (strategy or tf.distribute.get_strategy()).scope()
  with scope:
    model = language_model(family)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  losses = []
  record = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))
  model.fit(dataset(), epochs=1, verbose=0, callbacks=[record])
  return model, np.array(losses)


def expert_names(model):
  """Names of the stacked expert weights of a one-device model, and their
  whole bytes (from keras-hub's own variables)."""
  names, whole = set(), 0
  for block, _ in families.moe_blocks(model):
    for variable in block.weights:
      if variable.shape[0] == EXPERTS and len(variable.shape) >= 2:
        names.add(variable.name)
        whole += int(np.prod(variable.shape)) * 4
  return names, whole


class ExpertAccounting(VariableAccounting):
  """Live bytes per device of expert weights (and their optimizer slots):
  TensorFlow variables named after one of `names` (keras-hub's names of
  the stacked weights), or after the expert bank ("experts") and one of
  them (the slots' names hold the weight's path)."""

  def __init__(self, names):
    super().__init__()
    self.pattern = re.compile(
        "(^|experts_)(" + "|".join(map(re.escape, names)) + ")")

  def _record(self, variable):
    if self.pattern.search(variable.name):
      super()._record(variable)


def max_weight_difference(model, reference):
  ours = list(tfpar.logical_weights(model).values())
  theirs = list(tfpar.logical_weights(reference).values())
  assert len(ours) == len(theirs)
  return max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))


_RUNS = {}
_STRATEGIES = {}  # {(family, layout): the strategy it trained under}


@pytest.fixture(scope="module")
def runs():
  """{(family, layout): (model, losses, bytes per device or None)}, each
  trained once when first asked for."""

  def run(family, layout):
    key = (family, layout)
    if key not in _RUNS:
      if layout == "one device":
        _RUNS[key] = train(family) + (None,)
      else:
        reference = run(family, "one device")[0]
        names, _ = expert_names(reference)
        if layout == "expert":
          strategy = tfpar.ExpertParallelStrategy(
              tfpar.Mesh({"data": 4}), expert=EXPERT[family])
        else:
          strategy = tfpar.ExpertParallelStrategy(
              tfpar.Mesh({"data": 2, "tensor": 2}), expert=2,
              plan=EXPERT_TENSOR_PLANS.get(family, lambda: None)())
        accounting = ExpertAccounting(names)
        with accounting.counting():
          model, losses = train(family, strategy)
        _RUNS[key] = (model, losses, accounting.now())
        _STRATEGIES[key] = strategy
    return _RUNS[key]

  yield run
  _RUNS.clear()
  _STRATEGIES.clear()


STRUCTURE = {
    # family: (router, expert bank, stacked weights, shared expert)
    "mixtral": ("sparse_feedforward_gate_dense", "experts", 3, False),
    "qwen_moe": ("sparse_feedforward_gate_dense", "experts", 2, True),
    "qwen3_moe": ("sparse_feedforward_gate_dense", "experts", 2, False),
    "gpt_oss": ("router", "experts", 4, False),
    "qwen3_5_moe": ("router_gate", "experts", 2, True),
}


def test_every_family_is_found_by_its_layers(runs):
  for family, (router, bank, count, shared) in STRUCTURE.items():
    model = runs(family, "one device")[0]
    blocks = families.moe_blocks(model)
    assert len(blocks) == 1, family
    for _, layout in blocks:
      assert (layout.router.name, layout.bank.name,
              len(layout.expert_weight_names), layout.shared is not None) == (
                  router, bank, count, shared), family


@pytest.mark.parametrize("family", list(BACKBONES))
def test_expert_parallel_trains_as_one_device(runs, family):
  reference, reference_losses, _ = runs(family, "one device")
  model, losses, live = runs(family, "expert")
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  assert max_weight_difference(model, reference) < 1e-5
  # Each device holds 1/expert of the expert weights and of their momentum.
  _, whole = expert_names(reference)
  expert = EXPERT[family]
  assert live == {f"CPU:{d}": 2 * whole // expert for d in range(4)}, live


def described_styles(family, model):
  """{variable path: style name} as the expert x tensor strategy lays
  `model` out (`describe`'s table)."""
  lines = []
  _STRATEGIES[(family, "expert x tensor")].describe(model,
                                                   print_fn=lines.append)
  rows = re.findall(r"^(\S+/\S+)\s+\([^)]*\)\s+(\S+)",
                    "\n".join(lines), re.MULTILINE)
  return dict(rows)


@pytest.mark.parametrize("family", list(EXPERT_TENSOR_STYLES))
def test_expert_tensor_trains_as_one_device(runs, family):
  reference, reference_losses, _ = runs(family, "one device")
  model, losses, live = runs(family, "expert x tensor")
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5)
  assert max_weight_difference(model, reference) < 1e-5
  # Whole experts spread over expert 2 x tensor 2: a quarter per device.
  _, whole = expert_names(reference)
  assert live == {f"CPU:{d}": 2 * whole // 4 for d in range(4)}, live
  styles = described_styles(family, model)
  for pattern, style in EXPERT_TENSOR_STYLES[family].items():
    found = {p: s for p, s in styles.items() if re.search(pattern, p)}
    assert found and set(found.values()) == {style}, (pattern, found)


def test_qwen3_moe_query_key_norms_train_on_split_heads_as_one_device(runs):
  """The per-head query/key norm scales (shared by the heads, which
  tensor parallelism splits) moved in training, as on one device."""
  reference = tfpar.logical_weights(runs("qwen3_moe", "one device")[0])
  ours = tfpar.logical_weights(runs("qwen3_moe", "expert x tensor")[0])
  norms = [p for p in reference if re.search(r"(query|key)_dense_layernorm",
                                             p)]
  assert len(norms) == 2, list(reference)
  for path in norms:
    moved = np.abs(reference[path] - 1).max()  # From their ones.
    assert moved > 1e-4, path
    # A thousandth of what training moved them (an earlier run ended
    # 1.8e-4 off: about all of it).
    np.testing.assert_allclose(ours[path], reference[path],
                               atol=1e-3 * moved, rtol=0, err_msg=path)


class UnknownMoeBlock(keras.layers.Layer):
  """An MoE block of a class without a row: a router and stacked experts."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.num_experts, self.top_k = EXPERTS, TOP_K
    self.router = keras.layers.Dense(EXPERTS)
    self.bank = expert_bank.ExpertBank(EXPERTS, 8)

  def build(self, shape):
    self.router.build(shape)
    self.bank.build(shape)

  def call(self, x):
    return x + tf.reduce_sum(self.bank(x), 0) * tf.reduce_sum(
        self.router(x), -1, keepdims=True)


def test_unknown_or_unreadable_moe_blocks_are_refused():
  strategy = tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 4}), expert=2)
  with pytest.raises(ValueError, match=r"mixture-of-experts layer\(s\) tfpar "
                     r"does not know: .*UnknownMoeBlock.*add the class's row "
                     r"to ROWS in tfpar/expert_parallel/families.py"):
    with strategy.scope():
      inputs = keras.Input((HIDDEN,))
      keras.Model(inputs, UnknownMoeBlock()(inputs))
  # A known class whose layers are not a router, a bank and a shared
  # expert: refused before anything is split.
  block = moe_block.MoEBlock(EXPERTS, 8)
  block.extra = keras.layers.Dense(3)
  block.build((None, HIDDEN))
  with pytest.raises(ValueError, match=r"besides its router 'router' and "
                     r"expert bank 'experts' it has \['dense.*'\]"):
    families.family_of(block)
