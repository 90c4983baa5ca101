"""Keras's gradient clipping on ZeRO's gradient slices, as one device
clips: each norm summed over every replica's slices, and over the shards
of a tensor-parallel weight.

A split weight is one variable holding a different shard on each device
of a tensor group, and the strategy's `zero_sum_over_shards` sums its
norm over the group.
"""

import threading

import tensorflow as tf

from tfpar.common import strategy_hooks
from tfpar.common.clipping import clip_by_norm_of
from tfpar.zero import collectives


# The sums of squares of this trace's sparse gradients (`note_sparse`).
_sparse = threading.local()


def note_sparse(grads, variables):
  """Notes the sums of squares of the sparse gradients (an `Embedding`'s
  `IndexedSlices`) among `grads`, rows as they come: Keras clips them by
  those (a repeated row counted each time), and ZeRO reduces gradients
  dense before clipping. Each replica trace notes its own.

  Args:
    grads: this replica's gradients, before any reduction.
    variables: their Keras variables.
  """
  _sparse.squares = {
      id(v): tf.reduce_sum(tf.square(g.values))
      for g, v in zip(grads, variables) if isinstance(g, tf.IndexedSlices)}


def _squares(entries, grad_slices):
  """Each entry's sum of squares on this replica (its slice's, or its
  noted sparse gradient's)."""
  noted = getattr(_sparse, "squares", {})
  return tf.stack([noted[id(e.weight)] if id(e.weight) in noted else
                   tf.reduce_sum(tf.square(g))
                   for e, g in zip(entries, grad_slices)])


def clip(optimizer, state, entries, grad_slices):
  """The clipped gradient slices of `entries` (`sharded_optimizer.Entry`).

  Args:
    optimizer: the Keras optimizer (its clipping settings).
    state: its `ZeroState` (the strategy).
    entries: the weights updated.
    grad_slices: this replica's slices of their summed gradients.
  """
  phase = collectives.OPTIMIZER
  hooks = strategy_hooks.of(state.strategy)
  # Only per-device (SPMD) strategies hold split weights.
  over_shards = (hooks.zero_sum_over_shards
                 if hooks.zero_traces_per_replica > 1 else None)
  weights = [e.weight for e in entries]
  if optimizer.clipnorm and optimizer.clipnorm > 0:
    squares = collectives.all_reduce_sum(_squares(entries, grad_slices),
                                         phase, "clipnorm")
    if over_shards is not None:
      squares = over_shards(squares, weights)
    logical = [id(getattr(w, "_tfpar_shard_of", (w,))[0]) for w in weights]
    totals = {}
    for index, key in enumerate(logical):
      totals[key] = totals.get(key, 0.0) + squares[index]
    return [clip_by_norm_of(grad, totals[key], optimizer.clipnorm)
            for key, grad in zip(logical, grad_slices)]
  if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
    if over_shards is None:
      square = collectives.all_reduce_sum(
          tf.reduce_sum(_squares(entries, grad_slices))[None], phase,
          "global_clipnorm")[0]
    else:  # Replicated weights counted once, split ones over the group.
      square = tf.reduce_sum(over_shards(collectives.all_reduce_sum(
          _squares(entries, grad_slices), phase, "global_clipnorm"),
          weights))
    norm = tf.sqrt(square)
    clip_norm = optimizer.global_clipnorm
    scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (
        norm - norm)
    return [g * scale for g in grad_slices]
  if optimizer.clipvalue and optimizer.clipvalue > 0:
    value = optimizer.clipvalue
    return [tf.clip_by_value(g, -value, value) for g in grad_slices]
  return grad_slices
