"""`tfpar.MoE`: a mixture-of-experts layer for users' own Keras models."""

import numbers

import keras

from tfpar.expert_parallel import moe_block


def _check_settings(num_experts, intermediate_dim, top_k,
                    aux_loss_coefficient):
  """Raises a ValueError naming the first bad setting."""
  for name, value in (("num_experts", num_experts),
                      ("intermediate_dim", intermediate_dim),
                      ("top_k", top_k)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive integer. Received: "
                       f"{name}={value!r}")
  if top_k > num_experts:
    raise ValueError(
        f"top_k={top_k} must be between 1 and num_experts={num_experts} "
        f"(each token picks top_k distinct experts).")
  if (isinstance(aux_loss_coefficient, bool) or
      not isinstance(aux_loss_coefficient, numbers.Real) or
      not aux_loss_coefficient >= 0):
    raise ValueError(
        f"aux_loss_coefficient must be a number >= 0 (0 turns the "
        f"load-balancing loss off). Received: "
        f"aux_loss_coefficient={aux_loss_coefficient!r}")


@keras.saving.register_keras_serializable(package="tfpar")
class MoE(keras.layers.Layer):
  """A mixture-of-experts feed-forward layer, split over the expert group
  by `tfpar.ExpertParallelStrategy`.

  A router (Dense from the hidden size to `num_experts` logits, no bias)
  picks each token's `top_k` experts; the token's output is the sum of
  their outputs weighted by the softmax of the router logits over the
  chosen experts (Mixtral's routing; the raw top-k softmax probabilities
  with `normalize_top_k=False`). Each expert is an MLP from the hidden
  size back to it: gated as Mixtral's (`down(silu(x @ gate) * (x @ up))`)
  or plain (`down(activation(x @ up))`), its kernels stacked over experts
  ([num_experts, hidden, intermediate_dim] and
  [num_experts, intermediate_dim, hidden]). The output has the input's
  shape, so the layer replaces a Transformer's feed-forward (add the
  residual yourself).

  In training it adds the Switch-Transformer / Mixtral load-balancing
  loss, `aux_loss_coefficient * num_experts * sum_e f_e * P_e` (f_e the
  fraction of token assignments to expert e, P_e its mean router
  probability), with `add_loss`; tokens masked out by a Keras mask (e.g.
  `Embedding(mask_zero=True)`) do not count in it but still pass through
  the experts.

  Without a strategy it computes densely (every expert on every token).
  Built in `tfpar.ExpertParallelStrategy(...).scope()`, its experts are
  split over the expert group and tokens travel to them with all-to-alls;
  the load-balancing loss is then that of one device on the whole batch.

  Args:
    num_experts: experts in the layer (divisible by the strategy's
      `expert`).
    intermediate_dim: each expert's inner width.
    top_k: experts per token, in [1, num_experts].
    activation: a Keras activation (name or function), Mixtral's "silu"
      by default.
    gated: True for gated MLP experts (Mixtral's), False for plain ones.
    normalize_top_k: divide each token's top-k routing weights by their
      sum (Mixtral does).
    aux_loss_coefficient: weight of the load-balancing loss (keras-hub's
      Mixtral default 0.02); 0 turns it off.
    kernel_initializer: a Keras initializer for the router and experts.
    **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`).

  Raises:
    ValueError: a setting that is not a positive integer, `top_k` above
      `num_experts`, a negative `aux_loss_coefficient`.

  Example:

  >>> import keras
  >>> import numpy as np
  >>> import tfpar
  >>> tokens = keras.Input((8,), dtype="int32")
  >>> x = keras.layers.Embedding(100, 16)(tokens)
  >>> moe = tfpar.MoE(num_experts=4, intermediate_dim=32, top_k=2)
  >>> x = keras.layers.Add()([x, moe(x)])
  >>> model = keras.Model(tokens, keras.layers.Dense(100)(x))
  >>> model(np.ones((2, 8), "int32"), training=True).shape
  TensorShape([2, 8, 100])
  >>> len(model.losses)  # The load-balancing loss.
  1
  >>> tuple(moe.block.expert_bank.up_kernel.shape)  # [experts, hidden, inner]
  (4, 16, 32)
  """

  def __init__(self, num_experts, intermediate_dim, top_k=2,
               activation="silu", gated=True, normalize_top_k=True,
               aux_loss_coefficient=0.02, kernel_initializer="glorot_uniform",
               **kwargs):
    if kwargs.get("name") is None:  # Keras would call it "mo_e".
      uid = keras.backend.get_uid("moe")
      kwargs["name"] = "moe" if uid == 1 else f"moe_{uid - 1}"
    super().__init__(**kwargs)
    _check_settings(num_experts, intermediate_dim, top_k,
                    aux_loss_coefficient)
    self.num_experts = num_experts
    self.intermediate_dim = intermediate_dim
    self.top_k = top_k
    self.activation = keras.activations.get(activation)
    self.gated = bool(gated)
    self.normalize_top_k = bool(normalize_top_k)
    self.aux_loss_coefficient = aux_loss_coefficient
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.supports_masking = True
    self.block = moe_block.MoEBlock(
        num_experts, intermediate_dim, top_k=top_k,
        activation=self.activation, gated=self.gated,
        normalize_top_k=self.normalize_top_k,
        aux_loss_coefficient=aux_loss_coefficient,
        kernel_initializer=self.kernel_initializer, dtype=self.dtype_policy,
        name="block")

  def build(self, input_shape):
    self.block.build(input_shape)

  def call(self, inputs, training=False, mask=None):
    outputs, _ = self.block(inputs, attention_mask=mask, training=training)
    return outputs

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    config = super().get_config()
    config.update(
        num_experts=self.num_experts,
        intermediate_dim=self.intermediate_dim,
        top_k=self.top_k,
        activation=keras.activations.serialize(self.activation),
        gated=self.gated,
        normalize_top_k=self.normalize_top_k,
        aux_loss_coefficient=self.aux_loss_coefficient,
        kernel_initializer=keras.initializers.serialize(
            self.kernel_initializer))
    return config
