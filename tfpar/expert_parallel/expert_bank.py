"""The experts of a `tfpar.MoE` layer: one MLP per expert, weights stacked.

Each weight is one [num_experts, ...] variable (as keras-hub's Mixtral
keeps them), so `ExpertParallelStrategy` can split it along its first axis
over the expert group.
"""

import keras
import tensorflow as tf

# The bank's weights, in the order `ExpertBank.compute` takes them.
GATED_WEIGHTS = ("gate_kernel", "up_kernel", "down_kernel")
PLAIN_WEIGHTS = ("up_kernel", "down_kernel")


def fresh_initializer(initializer):
  """A new instance of a Keras initializer: an instance built without a
  seed draws one at construction, so two weights of one shape would start
  equal if they shared it."""
  return keras.initializers.get(keras.initializers.serialize(initializer))


def _project(x, kernel):
  """x [E, N, a] through kernel [E, a, b]: [E, N, b], a batch matmul.

  Not `tf.einsum`: under a float16 policy TensorFlow's CPU einsum
  accumulates in float16 (its rounding depends on the blocking of the
  whole contraction), while a matmul accumulates in float32 and rounds
  each element once. Each expert's product then rounds the same whether
  its tokens come from one device or from every replica of its expert
  group, and so does its input gradient (per expert, then summed over the
  experts in expert order: `routing.dispatch`).
  """
  return tf.matmul(x, kernel)


class ExpertBank(keras.layers.Layer):
  """`num_experts` MLPs from the hidden size back to it, without biases.

  Gated (Mixtral's feed-forward): `down(activation(x @ gate) * (x @ up))`;
  plain: `down(activation(x @ up))`. Kernels: gate and up
  [num_experts, hidden, intermediate_dim], down
  [num_experts, intermediate_dim, hidden].

  Args:
    num_experts: experts in the bank.
    intermediate_dim: each expert's inner width.
    activation: a Keras activation (name or function).
    gated: whether each expert is a gated MLP.
    kernel_initializer: a Keras initializer for every kernel.
    **kwargs: `keras.layers.Layer` arguments.

  Example:

  >>> bank = ExpertBank(num_experts=3, intermediate_dim=8)
  >>> bank(tf.ones([5, 4])).shape  # Every expert on every token.
  TensorShape([3, 5, 4])
  """

  def __init__(self, num_experts, intermediate_dim, activation="silu",
               gated=True, kernel_initializer="glorot_uniform", **kwargs):
    super().__init__(**kwargs)
    self.num_experts = num_experts
    self.intermediate_dim = intermediate_dim
    self.activation = keras.activations.get(activation)
    self.gated = gated
    self.kernel_initializer = keras.initializers.get(kernel_initializer)

  @property
  def weight_names(self):
    """The attributes holding the kernels, in `compute`'s order."""
    return GATED_WEIGHTS if self.gated else PLAIN_WEIGHTS

  def build(self, input_shape):
    hidden = input_shape[-1]
    inner = self.intermediate_dim
    shapes = {"gate_kernel": (self.num_experts, hidden, inner),
              "up_kernel": (self.num_experts, hidden, inner),
              "down_kernel": (self.num_experts, inner, hidden)}
    for name in self.weight_names:
      setattr(self, name, self.add_weight(
          shape=shapes[name],
          initializer=fresh_initializer(self.kernel_initializer), name=name))

  def compute(self, kernels, x):
    """Tokens through experts whose kernels are `kernels`.

    Args:
      kernels: tensors in `weight_names` order, each [E', ...]: all of the
        bank's experts, or the share of one replica of an expert group.
      x: [N, h], the same tokens for each of the E' experts, or
        [E', N, h], each expert's own tokens.

    Returns:
      [E', N, h]: expert e's output for its tokens.
    """
    if x.shape.rank == 2:
      # One copy of the tokens per expert, used by every projection of
      # that expert: each expert's input gradient is rounded on its own
      # and the copies' gradients are summed in expert order (the gradient
      # of `broadcast_to`), as the expert layouts sum a token's experts'.
      x = tf.broadcast_to(x[None], tf.concat([[kernels[0].shape[0]],
                                              tf.shape(x)], 0))
    if self.gated:
      gate, up, down = kernels
      inner = self.activation(_project(x, gate)) * _project(x, up)
    else:
      up, down = kernels
      inner = self.activation(_project(x, up))
    return _project(inner, down)

  def call(self, x):
    """Every expert on every token: x [T, h] to [num_experts, T, h]."""
    return self.compute([getattr(self, n) for n in self.weight_names], x)
