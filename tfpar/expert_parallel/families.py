"""The mixture-of-experts blocks tfpar splits over the expert group: one
table, `ROWS`.

A row says what an MoE block class does that its layers do not show (how
its router's output becomes each token's experts and weights, its
load-balancing loss); its router, stacked experts and shared expert are
found from its layers and weights (`structure.py`), and its experts run
through the block's own expert bank. Adding a keras-hub MoE family is one
row here.

A layer that looks like an MoE block (`num_experts`, `top_k` and a
sublayer of stacked [num_experts, ...] weights) but has no row is refused
by the strategies rather than left replicated (`unknown_moe_blocks`).
"""

from tfpar._compat import keras_layers
from tfpar.expert_parallel import moe_block
from tfpar.expert_parallel import structure

_QWEN_AUX = "router_aux_loss_coefficient"

# {block class name: structure.Row}. keras-hub's classes (matched by name
# in the `keras_hub` package) and `tfpar.MoE`'s block.
ROWS = {
    # softmax, top-k, weights renormalized; jitter on the router's input.
    "MixtralSparseMoeBlock": structure.Row(
        normalize=True, aux_coefficient="router_aux_loss_coef",
        jitter="router_jitter_noise"),
    # softmax, top-k, renormalized if norm_top_k_prob; shared expert.
    "QwenSparseMoeBlock": structure.Row(
        normalize="norm_top_k_prob", aux_coefficient=_QWEN_AUX),
    "Qwen3SparseMoeBlock": structure.Row(
        normalize="norm_top_k_prob", aux_coefficient=_QWEN_AUX),
    # softmax, top-k, always renormalized; shared expert.
    "Qwen3_5MoeSparseMoeBlock": structure.Row(
        normalize=True, aux_coefficient=_QWEN_AUX),
    # The router (with bias) returns scores: softmax over the top-k logits.
    # No load-balancing loss.
    "GptOssSparseMoeBlock": structure.Row(scores=True),
    # tfpar.MoE.
    "MoEBlock": structure.Row(
        normalize="normalize_top_k", aux_coefficient="aux_loss_coefficient",
        contraction="matmul", bank_compute="compute"),
}


def _row_name(layer):
  for cls in type(layer).__mro__:
    if cls.__name__ in ROWS and (cls.__module__.startswith("keras_hub.") or
                                 cls is moe_block.MoEBlock):
      return cls.__name__
  return None


def family_of(layer):
  """The `structure.MoELayout` of a built MoE block, or None for any other
  layer.

  Raises:
    ValueError: a block of a known class whose layers tfpar cannot read.

  Example:

  >>> import keras
  >>> import tensorflow as tf
  >>> family_of(keras.layers.Dense(2)) is None
  True
  >>> block = moe_block.MoEBlock(num_experts=4, intermediate_dim=8)
  >>> _ = block(tf.ones([1, 3, 6]))
  >>> layout = family_of(block)
  >>> layout.name, layout.router.name, layout.expert_weight_names
  ('MoEBlock', 'router', ('gate_kernel', 'up_kernel', 'down_kernel'))
  """
  name = _row_name(layer)
  if name is None:
    return None
  layout = getattr(layer, "_tfpar_moe_layout", None)
  if layout is None:  # Read once, before the experts are split.
    layout = structure.layout_of(layer, name, ROWS[name])
    object.__setattr__(layer, "_tfpar_moe_layout", layout)
  return layout


def moe_blocks(model):
  """[(block, `structure.MoELayout`)] of every MoE block of a built
  `model`, in layer order."""
  found = []
  for layer in keras_layers.flatten_layers(model, include_self=False):
    layout = family_of(layer)
    if layout is not None:
      found.append((layer, layout))
  return found


def unknown_moe_blocks(model):
  """Layers of `model` that look like MoE blocks (`num_experts`, `top_k`
  and a direct sublayer of stacked [num_experts, ...] weights) but have no
  row in `ROWS`."""
  unknown = []
  for layer in keras_layers.flatten_layers(model, include_self=False):
    num_experts = getattr(layer, "num_experts", None)
    if (_row_name(layer) is not None or not isinstance(num_experts, int) or
        not hasattr(layer, "top_k")):
      continue
    children = keras_layers.flatten_layers(layer, include_self=False,
                                           recursive=False)
    if any(len(v.shape) >= 3 and v.shape[0] == num_experts
           for child in children
           for v in keras_layers.own_variables(child)):
      unknown.append(layer)
  return unknown
