"""Top-k routing with a capacity per expert, and the load-balancing loss.

Each of a replica's T tokens picks its top-k experts. Expert e takes at
most C tokens of each replica (its capacity), in priority order: every
token's first choice before any token's second choice (GShard, DeepSpeed),
then token order. An assignment past the capacity is dropped: that expert
adds nothing to the token (the residual connection carries it).

Slot `e * C + p` of a replica's dispatch buffer holds the p-th token (in
token order, `slots`) it sends to expert e; the buffer's extra
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
  """Which assignments are kept, and each kept one's slot in the dispatch
  buffer.

  Expert e keeps at most C assignments, by priority: every token's first
  choice before any token's second choice, then token order (GShard,
  DeepSpeed). Its kept tokens are then placed in the order of the tokens
  themselves, so that an expert's kernel gradient adds its tokens' terms
  in the order one device's dense computation adds them.

  Args:
    experts: [T, k] chosen experts.
    num_experts: E.
    capacity_per_expert: C.

  Returns:
    (slot [T, k] int32: `e * C + position` with the position among e's
     kept tokens in token order, or `E * C` when dropped;
     kept [T, k] bool)

  Example:

  >>> slot, kept = slots(tf.constant([[0, 1], [0, 1], [0, 2]]), 3, 2)
  >>> kept.numpy().tolist()  # Token 2's first choice is past capacity 2.
  [[True, True], [True, True], [False, True]]
  >>> slot.numpy().tolist()
  [[0, 2], [1, 3], [6, 4]]
  >>> slot, kept = slots(tf.constant([[0, 1], [1, 0]]), 2, 2)
  >>> slot.numpy().tolist()  # Expert 0 holds token 0, then token 1.
  [[0, 2], [3, 1]]
  """
  tokens = tf.shape(experts)[0]
  top_k = experts.shape[1]
  # Priority positions: [k * T, E], k-major (first choices first).
  one_hot = tf.one_hot(tf.transpose(experts), num_experts, dtype=tf.int32)
  one_hot = tf.reshape(one_hot, [-1, num_experts])
  position = tf.math.cumsum(one_hot, axis=0, exclusive=True)
  position = tf.reduce_sum(position * one_hot, axis=1)
  position = tf.transpose(tf.reshape(position, [top_k, tokens]))  # [T, k]
  kept = position < capacity_per_expert
  # Positions among each expert's kept tokens: [T * k, E], token-major.
  chosen = tf.one_hot(experts, num_experts, dtype=tf.int32)
  chosen = chosen * tf.cast(kept, tf.int32)[..., None]
  flat = tf.reshape(chosen, [-1, num_experts])
  position = tf.reduce_sum(
      tf.math.cumsum(flat, axis=0, exclusive=True) * flat, axis=1)
  position = tf.reshape(position, [-1, top_k])
  slot = tf.where(kept, experts * capacity_per_expert + position,
                  num_experts * capacity_per_expert)
  return slot, kept


def dispatch(tokens, slot, buffer_rows, experts):
  """The dispatch buffer [buffer_rows, h]: row s holds the token whose
  assignment has slot s (zeros where none does).

  Each token's k copies are taken in expert order, so that the gradient of
  the copies (a float16 sum under mixed_float16, which TensorFlow's CPU
  `Sum` accumulates in float16, one element after the other) adds the
  token's experts' input gradients in the order one device's dense block
  adds every expert's (`expert_bank.ExpertBank.compute`).

  Args:
    tokens: [T, h] the replica's tokens.
    slot: [T, k] from `slots` (dropped assignments point at
      `buffer_rows`).
    buffer_rows: E * C.
    experts: [T, k] the chosen experts.

  Example:

  >>> tokens = tf.constant([[1.0], [2.0]])
  >>> dispatch(tokens, tf.constant([[2, 0], [1, 4]]), 4,
  ...          tf.constant([[1, 0], [0, 1]])).numpy().ravel().tolist()
  [1.0, 2.0, 1.0, 0.0]
  """
  hidden = tokens.shape[-1]
  order = tf.argsort(experts, axis=1, stable=True)
  slot = tf.gather(slot, order, batch_dims=1)
  repeated = tf.repeat(tokens, slot.shape[1], axis=0)  # [T * k, h].
  buffer = tf.scatter_nd(tf.reshape(slot, [-1, 1]), repeated,
                         tf.stack([buffer_rows + 1, hidden]))
  return buffer[:-1]


def combine(expert_out, slot, weights, experts, contraction="multiply"):
  """Each token's sum over its kept assignments of weight x expert output,
  rounded as the MoE block's own one-device computation rounds it.

  The k assignments are taken in expert order, as a dense block sums over
  the experts. keras-hub's blocks multiply [E, T, h] outputs by their
  weights and sum the products ("multiply"); `tfpar.MoE`'s block gathers
  each token's k outputs on one device too and takes the weighted sum as
  one batch matmul per token ("matmul", float32 accumulation rounded
  once), so that the sum and its gradients (the routing weights' a dot
  product over the hidden units) round alike for any number of experts,
  tokens or replicas.

  Args:
    expert_out: [E * C, h] the experts' outputs in dispatch-buffer order.
    slot: [T, k] from `slots` (dropped assignments point past the
      end).
    weights: [T, k] routing weights.
    experts: [T, k] the chosen experts.
    contraction: "multiply" or "matmul" (`families.Family.contraction`).

  Example:

  >>> out = tf.constant([[1.0], [10.0], [100.0]])  # Rows 0-2 of E * C.
  >>> combine(out, tf.constant([[2, 0], [1, 3]]), tf.constant(
  ...     [[0.5, 0.25], [1.0, 1.0]]), tf.constant([[1, 0], [0, 1]]),
  ...     "matmul").numpy().ravel().tolist()  # 0.25 + 50; 10 + dropped.
  [50.25, 10.0]
  """
  order = tf.argsort(experts, axis=1, stable=True)
  slot = tf.gather(slot, order, batch_dims=1)  # [T, k], expert order.
  weights = tf.gather(weights, order, batch_dims=1)
  padded = tf.concat([expert_out, tf.zeros_like(expert_out[:1])], 0)
  if contraction == "matmul":
    gathered = tf.gather(padded, slot)  # [T, k, h]
    weights = tf.cast(weights, gathered.dtype)
    return tf.matmul(weights[:, None, :], gathered)[:, 0, :]
  gathered = tf.gather(padded, tf.transpose(slot))  # [k, T, h]
  weights = tf.cast(tf.transpose(weights), gathered.dtype)
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
