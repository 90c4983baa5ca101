"""The router and experts inside a `tfpar.MoE` layer.

`MoEBlock` keeps the contract of keras-hub's sparse MoE blocks that
`ExpertParallelStrategy` runs expert-parallel (`families.py`, `layers.py`):
its `call(hidden_states, attention_mask, training)` returns
`(output, router_logits)`, its experts are the stacked weights of
`expert_bank`, and its router is `router` (its `Family` says so). The
strategy replaces its `call` (which is why `tfpar.MoE`, whose
call returns the output alone, wraps it rather than being it).

On its own it computes densely, as keras-hub's Mixtral block does: every
expert runs on every token and each token sums its top-k experts' outputs
(`routing.combine`, as the expert layouts do).
"""

import keras
import tensorflow as tf

from tfpar.expert_parallel import expert_bank
from tfpar.expert_parallel import routing


class MoEBlock(keras.layers.Layer):
  """A router (Dense to `num_experts` logits, no bias) and an
  `ExpertBank`; see `tfpar.MoE` for the arguments.

  Example:

  >>> block = MoEBlock(num_experts=4, intermediate_dim=8, top_k=2)
  >>> out, router_logits = block(tf.ones([2, 3, 6]), training=True)
  >>> out.shape, router_logits.shape, len(block.losses)
  (TensorShape([2, 3, 6]), TensorShape([6, 4]), 1)
  """

  def __init__(self, num_experts, intermediate_dim, top_k=2,
               activation="silu", gated=True, normalize_top_k=True,
               aux_loss_coefficient=0.02, kernel_initializer="glorot_uniform",
               **kwargs):
    super().__init__(**kwargs)
    self.num_experts = num_experts
    self.top_k = top_k
    self.gated = gated
    self.normalize_top_k = normalize_top_k
    self.aux_loss_coefficient = aux_loss_coefficient
    self.hidden_dim = None  # Known when built.
    self.supports_masking = True
    initializer = keras.initializers.get(kernel_initializer)
    self.router = keras.layers.Dense(
        num_experts, use_bias=False,
        kernel_initializer=expert_bank.fresh_initializer(initializer),
        dtype=self.dtype_policy, name="router")
    self.expert_bank = expert_bank.ExpertBank(
        num_experts, intermediate_dim, activation=activation, gated=gated,
        kernel_initializer=initializer, dtype=self.dtype_policy,
        name="experts")

  def build(self, input_shape):
    self.hidden_dim = input_shape[-1]
    self.router.build(input_shape)
    self.expert_bank.build(input_shape)

  def compute_mask(self, inputs, mask=None):
    return mask, None  # The output keeps the input's mask; logits none.

  def call(self, hidden_states, attention_mask=None, training=False):
    """(output shaped as `hidden_states`, router logits [tokens, E])."""
    x = tf.reshape(hidden_states, [-1, self.hidden_dim])
    router_logits = self.router(x)
    router_probs = tf.nn.softmax(router_logits, axis=-1)
    weights, experts = routing.route(router_probs, self.top_k,
                                     self.normalize_top_k)
    expert_out = self.expert_bank(x)  # [E, T, h]
    # Each token's k outputs, combined as the expert layouts combine them
    # (row e * T + t of expert_out is expert e's output for token t).
    tokens = tf.shape(x)[0]
    slot = experts * tokens + tf.range(tokens)[:, None]
    out = routing.combine(tf.reshape(expert_out, [-1, self.hidden_dim]),
                          slot, weights, experts, contraction="matmul")
    if training:
      mask = (tf.ones_like(router_probs[:, 0]) if attention_mask is None
              else tf.reshape(attention_mask, [-1]))
      aux = routing.load_balancing_loss(router_probs, experts,
                                        self.num_experts, mask,
                                        global_sum=lambda total: total)
      self.add_loss(self.aux_loss_coefficient * aux)
    return tf.reshape(out, tf.shape(hidden_states)), router_logits
