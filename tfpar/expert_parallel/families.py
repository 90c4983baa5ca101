"""The mixture-of-experts layers tfpar splits over the expert group.

A `Family` says where an MoE block keeps its router and experts and how it
computes, so that `layers.py` can run the block expert-parallel with
keras-hub's own weights and activation. Registered: keras-hub's
`MixtralSparseMoeBlock` and `QwenSparseMoeBlock` (Qwen-MoE, with its shared
expert), and the block inside tfpar's own `tfpar.MoE` layer
(`moe_block.MoEBlock`, gated or plain experts).
"""

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from tfpar._compat import keras_hub_names
from tfpar._compat import keras_layers
from tfpar.expert_parallel import expert_bank
from tfpar.expert_parallel import moe_block


@dataclasses.dataclass(frozen=True)
class Family:
  """How one MoE block class is laid out.

  Attributes:
    name: the block's class name (a keras-hub class), or a label when
      `matches` is given.
    expert_weight_names: attributes of `block.expert_bank` holding the
      [num_experts, ...] expert weights, in the order `experts` takes them.
    experts: `experts(bank, weights, x)`: x [E_local, N, h] through the
      local experts, whose weights are `weights`.
    normalize: `normalize(block)`: whether the top-k weights are divided
      by their sum.
    aux_coefficient: the block's attribute with the loss coefficient.
    flat_mask: `flat_mask(attention_mask)`: [T] mask of the tokens that
      count in the load-balancing loss.
    extra: `extra(block, x_flat)`: what the block adds to the experts'
      output (a shared expert), or None.
    jitter: the block's attribute with the router's jitter noise, or None.
    matches: `matches(layer)`: whether `layer` is of this family; None for
      an instance of the keras-hub class `name`.
    router: the block's attribute holding its router layer; None for
      keras-hub's (private) name.
    contraction: how the block's own (dense) call sums each token's
      weighted expert outputs, for `routing.combine` to round as it does:
      "multiply" (products, then a sum: keras-hub's) or "matmul"
      (`moe_block`'s, which calls `routing.combine` itself).
  """
  name: str
  expert_weight_names: tuple
  experts: Callable
  normalize: Callable
  aux_coefficient: str
  flat_mask: Callable
  extra: Optional[Callable] = None
  jitter: Optional[str] = None
  matches: Optional[Callable] = None
  router: Optional[str] = None
  contraction: str = "multiply"

  def router_of(self, block):
    """The block's router layer."""
    if self.router is None:
      return keras_hub_names.router(block)
    return getattr(block, self.router)


def _mixtral_experts(bank, weights, x):
  gate_kernel, intermediate_kernel, output_kernel = weights
  gate = tf.einsum("enh,ehm->enm", x, gate_kernel)
  gate = tf.cast(bank.activation(tf.cast(gate, "float32")), x.dtype)
  intermediate = tf.einsum("enh,ehm->enm", x, intermediate_kernel)
  return tf.einsum("enm,emh->enh", intermediate * gate, output_kernel)


def _qwen_experts(bank, weights, x):
  gate_up_kernel, output_kernel = weights
  gate, up = tf.split(tf.einsum("enh,ehm->enm", x, gate_up_kernel), 2,
                      axis=-1)
  return tf.einsum("enm,emh->enh", up * bank.activation(gate), output_kernel)


def _tfpar_experts(bank, weights, x):
  return bank.compute(weights, x)


def _tfpar_block(gated):
  return lambda layer: (isinstance(layer, moe_block.MoEBlock) and
                        layer.gated == gated)


def _mixtral_mask(attention_mask):
  return tf.reshape(attention_mask, [-1])


def _qwen_mask(attention_mask):
  return tf.reshape(tf.reduce_any(tf.cast(attention_mask, tf.bool), -1), [-1])


def _qwen_shared_expert(block, x):
  shared = block.shared_expert_dense(x)
  return shared * tf.sigmoid(block.shared_expert_gate_dense(x))


FAMILIES = (
    Family("MixtralSparseMoeBlock",
           keras_hub_names.MIXTRAL_EXPERT_WEIGHTS,
           _mixtral_experts, normalize=lambda block: True,
           aux_coefficient="router_aux_loss_coef", flat_mask=_mixtral_mask,
           jitter="router_jitter_noise"),
    Family("QwenSparseMoeBlock",
           keras_hub_names.QWEN_MOE_EXPERT_WEIGHTS,
           _qwen_experts, normalize=lambda block: bool(block.norm_top_k_prob),
           aux_coefficient="router_aux_loss_coefficient",
           flat_mask=_qwen_mask, extra=_qwen_shared_expert),
    Family("tfpar.MoE (gated=True)", expert_bank.GATED_WEIGHTS,
           _tfpar_experts, normalize=lambda block: block.normalize_top_k,
           aux_coefficient="aux_loss_coefficient", flat_mask=_mixtral_mask,
           matches=_tfpar_block(gated=True), router="router",
           contraction="matmul"),
    Family("tfpar.MoE (gated=False)", expert_bank.PLAIN_WEIGHTS,
           _tfpar_experts, normalize=lambda block: block.normalize_top_k,
           aux_coefficient="aux_loss_coefficient", flat_mask=_mixtral_mask,
           matches=_tfpar_block(gated=False), router="router",
           contraction="matmul"),
)


def _is_of(family, layer):
  if family.matches is not None:
    return family.matches(layer)
  return any(cls.__name__ == family.name and
             cls.__module__.startswith("keras_hub.")
             for cls in type(layer).__mro__)


def family_of(layer):
  """The `Family` of an MoE block, or None for any other layer.

  Example:

  >>> import keras
  >>> family_of(keras.layers.Dense(2)) is None
  True
  >>> family_of(moe_block.MoEBlock(num_experts=4, intermediate_dim=8)).name
  'tfpar.MoE (gated=True)'
  """
  return next((f for f in FAMILIES if _is_of(f, layer)), None)


def moe_blocks(model):
  """[(block, family)] of every MoE block in `model`, in layer order."""
  found = []
  for layer in keras_layers.flatten_layers(model, include_self=False):
    family = family_of(layer)
    if family is not None:
      found.append((layer, family))
  return found
