"""Top-k routing with a capacity per expert, and the load-balancing loss.

Each of a replica's T tokens picks its top-k experts. Expert e takes at
most C tokens of each replica (its capacity), in priority order: every
token's first choice before any token's second choice (GShard, DeepSpeed),
then token order. An assignment past the capacity is dropped: that expert
adds nothing to the token (the residual connection carries it).

Slot `e * C + p` of a replica's dispatch buffer holds the p-th token (in
token order, `in_token_order`) it sends to expert e; the buffer's extra
last row collects what is dropped.
"""

import math
import numbers

import tensorflow as tf


def check_capacity_factor(capacity_factor):
  """Raises unless `capacity_factor` is None or a positive number.

  Example:

  >>> check_capacity_factor(1.25)
  >>> check_capacity_factor(0)
  Traceback (most recent call last):
  ...
  ValueError: capacity_factor must be None (drop nothing) or a positive number. Received: capacity_factor=0
  """
  if capacity_factor is not None and (
      isinstance(capacity_factor, bool) or
      not isinstance(capacity_factor, numbers.Real) or
      not capacity_factor > 0):
    raise ValueError(
        f"capacity_factor must be None (drop nothing) or a positive "
        f"number. Received: capacity_factor={capacity_factor!r}")


def capacity(tokens, num_experts, top_k, capacity_factor):
  """Tokens each expert takes from one replica.

  Args:
    tokens: the replica's token count (an int or a scalar tensor).
    num_experts: experts of the layer.
    top_k: experts per token.
    capacity_factor: None for no limit (every token fits: C = tokens), else
      C = ceil(capacity_factor * tokens * top_k / num_experts).

  Example:

  >>> capacity(64, num_experts=4, top_k=2, capacity_factor=1.0)
  32
  >>> capacity(64, num_experts=4, top_k=2, capacity_factor=None)
  64
  """
  if capacity_factor is None:
    return tokens
  if isinstance(tokens, int):
    return min(tokens, max(1, math.ceil(capacity_factor * tokens * top_k /
                                        num_experts)))
  wanted = tf.math.ceil(capacity_factor * tf.cast(tokens * top_k, tf.float32)
                        / num_experts)
  return tf.minimum(tokens, tf.maximum(1, tf.cast(wanted, tokens.dtype)))


def route(router_probs, top_k, normalize):
  """The top-k experts of every token and their weights.

  Args:
    router_probs: [T, E] softmax of the router logits.
    top_k: experts per token.
    normalize: divide the k weights by their sum.

  Returns:
    (weights [T, k], experts [T, k] int32)
  """
  weights, experts = tf.math.top_k(router_probs, k=top_k)
  if normalize:
    weights = weights / tf.reduce_sum(weights, axis=-1, keepdims=True)
  return weights, experts


def slots(experts, num_experts, capacity_per_expert):
  """Each assignment's slot in the dispatch buffer.

  Args:
    experts: [T, k] chosen experts.
    num_experts: E.
    capacity_per_expert: C.

  Returns:
    (slot [T, k] int32: `e * C + position`, or `E * C` when dropped;
     kept [T, k] bool)

  Example:

  >>> slot, kept = slots(tf.constant([[0, 1], [0, 1], [0, 2]]), 3, 2)
  >>> slot.numpy().tolist()  # Token 2's first choice is past capacity 2.
  [[0, 2], [1, 3], [6, 4]]
  >>> kept.numpy().tolist()
  [[True, True], [True, True], [False, True]]
  """
  tokens = tf.shape(experts)[0]
  top_k = experts.shape[1]
  one_hot = tf.one_hot(tf.transpose(experts), num_experts, dtype=tf.int32)
  one_hot = tf.reshape(one_hot, [-1, num_experts])  # [k * T, E], k-major.
  position = tf.math.cumsum(one_hot, axis=0, exclusive=True)
  position = tf.reduce_sum(position * one_hot, axis=1)
  position = tf.transpose(tf.reshape(position, [top_k, tokens]))  # [T, k]
  kept = position < capacity_per_expert
  slot = tf.where(kept, experts * capacity_per_expert + position,
                  num_experts * capacity_per_expert)
  return slot, kept


def dispatch(tokens, slot, buffer_rows):
  """The dispatch buffer [buffer_rows, h]: row s holds the token whose
  assignment has slot s (zeros where none does)."""
  top_k = slot.shape[1]
  hidden = tokens.shape[-1]
  repeated = tf.repeat(tokens, top_k, axis=0)  # [T * k, h], token-major.
  buffer = tf.scatter_nd(tf.reshape(slot, [-1, 1]), repeated,
                         tf.stack([buffer_rows + 1, hidden]))
  return buffer[:-1]


def in_token_order(experts, kept, num_experts, capacity_per_expert):
  """The slots of the kept assignments renumbered in token order.

  `slots` decides which assignments are kept by priority (first choices
  first); this places each expert's kept tokens in the order of the tokens
  themselves, so that an expert's kernel gradient adds its tokens' terms
  in the order one device's dense computation adds them (a compute-dtype
  matmul that accumulates in that dtype, as float16 kernels on CPU do,
  rounds differently in another order).

  Args:
    experts: [T, k] chosen experts.
    kept: [T, k] bool, from `slots`.
    num_experts: E.
    capacity_per_expert: C.

  Returns:
    slot [T, k] int32: `e * C + position`, or `E * C` when dropped.

  Example:

  >>> experts = tf.constant([[0, 1], [1, 0]])
  >>> slot, kept = slots(experts, 2, 2)
  >>> slot.numpy().tolist()  # First choices first: token 1's 1 before 0's.
  [[0, 3], [2, 1]]
  >>> in_token_order(experts, kept, 2, 2).numpy().tolist()
  [[0, 2], [3, 1]]
  """
  top_k = experts.shape[1]
  chosen = tf.one_hot(experts, num_experts, dtype=tf.int32)  # [T, k, E]
  chosen = chosen * tf.cast(kept, tf.int32)[..., None]
  flat = tf.reshape(chosen, [-1, num_experts])  # [T * k, E], token-major.
  position = tf.reduce_sum(
      tf.math.cumsum(flat, axis=0, exclusive=True) * flat, axis=1)
  position = tf.reshape(position, [-1, top_k])
  return tf.where(kept, experts * capacity_per_expert + position,
                  num_experts * capacity_per_expert)


def combine(expert_out, slot, weights, experts, contraction="multiply"):
  """Each token's sum over its kept assignments of weight x expert output,
  rounded as the MoE block's own one-device computation rounds it.

  The k assignments are taken in expert order, as a dense block sums over
  the experts. keras-hub's blocks multiply [E, T, h] outputs by their
  weights and sum the products ("multiply"); `tfpar.MoE`'s contracts them
  in one einsum ("einsum"), which under a mixed policy rounds the sum
  once: there, products rounded first put the first loss 1.7e-6 off one
  device's under mixed_bfloat16, and another einsum layout 3.3e-6 off
  under mixed_float16 with 4 assignments (now equal).

  Args:
    expert_out: [E * C, h] the experts' outputs in dispatch-buffer order.
    slot: [T, k] from `slots` or `in_token_order` (dropped assignments
      point past the end).
    weights: [T, k] routing weights.
    experts: [T, k] the chosen experts.
    contraction: "multiply" or "einsum" (`families.Family.contraction`).
  """
  order = tf.argsort(experts, axis=1, stable=True)
  slot = tf.transpose(tf.gather(slot, order, batch_dims=1))  # [k, T]
  weights = tf.transpose(tf.gather(weights, order, batch_dims=1))
  padded = tf.concat([expert_out, tf.zeros_like(expert_out[:1])], 0)
  gathered = tf.gather(padded, slot)  # [k, T, h]
  weights = tf.cast(weights, gathered.dtype)
  if contraction == "einsum":
    return tf.einsum("kth,kt->th", gathered, weights)
  return tf.reduce_sum(gathered * weights[..., None], axis=0)


def load_balancing_loss(router_probs, experts, num_experts, mask, global_sum):
  """Switch-Transformer / Mixtral auxiliary loss over the global batch.

  `num_experts * sum_e f_e * P_e`, where f_e is the fraction of (unmasked)
  assignments to expert e, averaged over the k choices, and P_e the mean
  router probability of expert e, both over the tokens of every replica,
  as one device computes them on the whole batch.

  Args:
    router_probs: [T, E].
    experts: [T, k].
    num_experts: E.
    mask: [T] float, 1 for tokens that count.
    global_sum: sums a tensor over every replica (differentiably).

  Returns:
    A float32 scalar, whatever the compute dtype (Keras sums a model's
    losses together, and its other losses are float32 under mixed
    policies).
  """
  router_probs = tf.cast(router_probs, tf.float32)
  mask = tf.cast(mask, router_probs.dtype)
  chosen = tf.one_hot(experts, num_experts, dtype=router_probs.dtype)
  counts = tf.reduce_sum(chosen * mask[:, None, None], axis=0)  # [k, E]
  probs = tf.reduce_sum(router_probs * mask[:, None], axis=0)  # [E]
  top_k = experts.shape[1]
  local = tf.concat([tf.reshape(tf.stop_gradient(counts), [-1]), probs,
                     tf.reduce_sum(mask)[None]], 0)
  total = global_sum(local)
  counts = tf.reshape(total[:top_k * num_experts], [top_k, num_experts])
  probs = total[top_k * num_experts:-1]
  denominator = tf.maximum(total[-1], 1e-9)
  tokens_per_expert = tf.reduce_mean(counts / denominator, axis=0)
  return tf.reduce_sum(tokens_per_expert * probs / denominator) * num_experts
