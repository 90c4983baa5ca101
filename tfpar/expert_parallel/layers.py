"""An MoE block's call, expert-parallel.

Per replica, on its own tokens: the (replicated) router picks each token's
top-k experts; the tokens are written into a dispatch buffer of C slots per
expert (`routing`), the buffer goes to the experts' replicas with an
all-to-all, each replica runs its E / expert experts on what it received,
and a second all-to-all brings the outputs back to be combined with the
routing weights. The load-balancing loss is computed from router
statistics summed over every replica, so it is the one-device loss of the
whole batch.

Under expert x tensor every device of a tensor group routes its copy of
the tokens and exchanges its own experts' rows (`spmd_exchange.py`).
Under expert x pipeline a block runs on its stage's device of each
replica, and its all-to-alls and statistics sums join those devices.

Outside a replica context (Keras tracing shapes, a call outside
`strategy.run`) the block computes on one device with the whole experts.
"""

import tensorflow as tf

from tfpar.expert_parallel import comm
from tfpar.expert_parallel import routing
from tfpar.expert_parallel import spmd_exchange


def _local_experts(family, weights, received, expert, capacity):
  """received [expert, E_local * C, h] (chunk i from member i) through the
  local experts (`weights`: their tensors); returns the outputs in the same
  layout."""
  hidden = received.shape[-1]
  local = weights[0].shape[0]
  x = tf.reshape(received, [expert, local, capacity, hidden])
  x = tf.reshape(tf.transpose(x, [1, 0, 2, 3]), [local, -1, hidden])
  out = family.experts(weights, x)
  out = tf.transpose(tf.reshape(out, [local, expert, capacity, hidden]),
                     [1, 0, 2, 3])
  return tf.reshape(out, [expert, local * capacity, hidden])


def flat_mask(attention_mask):
  """[T] mask of the tokens that count in the load-balancing loss, from a
  [B, S] padding mask (Mixtral, Qwen3.5-MoE, `tfpar.MoE`) or a
  [B, S, S] attention mask (Qwen-MoE, Qwen3-MoE: a token counts if it
  attends anywhere), as each block's own loss reads it."""
  if attention_mask.shape.rank == 3:
    attention_mask = tf.reduce_any(tf.cast(attention_mask, tf.bool), -1)
  return tf.reshape(attention_mask, [-1])


def build_call(block, family, context):
  """The expert-parallel `call` of `block`.

  Args:
    block: the keras-hub MoE block (its expert weights already split).
    family: its `structure.MoELayout`.
    context: the `MoEContext` of the strategy (groups, launchers, capacity
      factor, drop counters, whole weights for calls outside replicas).
  """
  bank = family.bank
  variables = [getattr(bank, name) for name in family.expert_weight_names]

  def call(hidden_states, attention_mask=None, training=False):
    shape = tf.shape(hidden_states)
    hidden = block.hidden_dim
    x = tf.reshape(hidden_states, [-1, hidden])
    jitter = getattr(block, family.jitter, 0.0) if family.jitter else 0.0
    if training and jitter > 0:
      x = x * tf.random.uniform(tf.shape(x), 1.0 - jitter, 1.0 + jitter,
                                dtype=x.dtype)
    router_out, router_probs, weights, experts = family.route(block, x)
    replica = context.replica_id()
    num_experts = block.num_experts
    tokens = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
    capacity = routing.capacity(tokens, num_experts, block.top_k,
                                context.capacity_factor)
    slot, kept = routing.slots(experts, num_experts, capacity)
    buffer = routing.dispatch(x, slot, num_experts * capacity, experts)
    if replica is None:  # One device, every expert here.
      whole = [tf.cast(context.whole_value(v), x.dtype) for v in variables]
      received = tf.reshape(buffer, [1, -1, hidden])
      out = _local_experts(family, whole, received, 1, capacity)
      expert_out = tf.reshape(out, [-1, hidden])
    else:
      expert = context.groups.expert
      # The replicas' devices running this block (a pipeline stage's; under
      # SPMD the running trace's).
      launcher = context.launchers.all_to_all(
          replica, context.token_column(block))

      def run_local(received):
        # Cast as Keras autocasts variables under mixed precision.
        local = [tf.cast(v.value, x.dtype) for v in variables]
        return _local_experts(family, local, received, expert, capacity)

      if context.per_device:
        expert_out = spmd_exchange.exchange(
            buffer, expert, context.tensor_groups, launcher, run_local,
            block.name)
      else:
        chunks = tf.reshape(buffer, [expert, -1, hidden])
        received = comm.all_to_all(chunks, launcher, block.name)
        back = comm.all_to_all(run_local(received), launcher, block.name)
        expert_out = tf.reshape(back, [-1, hidden])
      context.count_drops(block, kept)
    out = routing.combine(expert_out, slot, weights, experts,
                          family.contraction)
    if family.shared is not None:
      out = out + family.extra(x)
    out = tf.reshape(out, shape)
    if training and family.aux_coefficient and router_probs is not None:
      mask = (tf.ones_like(router_probs[:, 0]) if attention_mask is None
              else tf.cast(flat_mask(attention_mask), router_probs.dtype))
      global_sum = ((lambda v: v) if replica is None else
                    (lambda v: comm.sum_over_replicas(
                        v, context.launchers.everyone(
                            replica, context.token_column(block)),
                        block.name)))
      aux = routing.load_balancing_loss(router_probs, experts, num_experts,
                                        mask, global_sum)
      block.add_loss(getattr(block, family.aux_coefficient) * aux)
    return out, router_out

  return call
