"""Gradient clipping of an expert-parallel model as one device clips.

Keras clips each replica's gradients before they are summed over replicas,
and would take an expert weight's norm from the replica's own experts
only. Here the gradients are summed first (the experts' over their
expert-data groups, the others over every replica), then clipped by the
norms of whole weights:

* `clipnorm`: each weight by its own norm. A tensor-split weight's squares
  are summed over its shards; an expert weight's over its tensor columns on
  the replica and then over the expert group (one all-reduce of every
  expert weight's sum at once), since the replicas of an expert group hold
  each expert once between them.
* `global_clipnorm`: every gradient by the norm of all of them: the
  replicated and tensor-split gradients' squares (the same on every
  replica) plus the experts' squares summed over the expert group.
* `clipvalue`: element by element, after the sums.
"""

import tensorflow as tf
from keras import ops

from tfpar._compat import keras_layers
from tfpar._compat import keras_optimizers
from tfpar.common.clipping import clip_by_norm_of
from tfpar.common.split_weights import sharded_weights


def install(optimizer, context, model, all_reduce_sum):
  """Makes `optimizer` skip Keras's per-replica clipping and clip after
  `all_reduce_sum(grads_and_vars)` (the expert-parallel sums) by the norms
  of whole weights, as one device does.

  Args:
    optimizer: the optimizer holding the clipping settings (the inner one
      of a `LossScaleOptimizer`).
    context: the strategy's `MoEContext`.
    model: the model (its tensor-split weights' shards are grouped).
    all_reduce_sum: the function summing gradients over replicas.
  """
  groups = {}
  for weight in sharded_weights(model).values():
    for shard in weight.shards:
      groups[id(keras_layers.storage(shard))] = weight.path

  def all_reduce_then_clip(grads_and_vars):
    for weight in context.expert_weights():
      for variable in weight.variables:
        groups[id(variable.value)] = ("expert", weight.path)
        groups[id(keras_layers.storage(variable))] = ("expert", weight.path)
    pairs = list(all_reduce_sum(grads_and_vars))
    grads = [g for g, _ in pairs]
    replica = context.replica_id()
    if optimizer.clipnorm and optimizer.clipnorm > 0:
      keys = [groups.get(id(v), id(v)) for _, v in pairs]
      sums = {}
      for key, grad in zip(keys, grads):
        if grad is not None:
          sums[key] = sums.get(key, 0.0) + ops.sum(ops.square(grad))
      expert_keys = sorted({k for k in keys if isinstance(k, tuple)})
      if expert_keys:
        summed = _over_expert_group(
            context, replica, tf.stack([sums[k] for k in expert_keys]))
        sums.update({k: summed[i] for i, k in enumerate(expert_keys)})
      grads = [None if g is None else clip_by_norm_of(g, sums[k],
                                                       optimizer.clipnorm)
               for g, k in zip(grads, keys)]
    elif optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
      others, experts = tf.constant(0.0), tf.constant(0.0)
      for grad, (_, variable) in zip(grads, pairs):
        if grad is None:
          continue
        # As Keras's global_norm (an IndexedSlices' rows one by one).
        square = ops.sum(ops.square(grad))
        if isinstance(groups.get(id(variable)), tuple):
          experts += square
        else:
          others += square
      norm = tf.sqrt(others + _over_expert_group(context, replica, experts))
      clip = optimizer.global_clipnorm
      # Keras's clip_by_global_norm (a NaN norm gives NaN gradients).
      scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
      grads = [None if g is None else g * scale for g in grads]
    elif optimizer.clipvalue and optimizer.clipvalue > 0:
      value = optimizer.clipvalue
      grads = [None if g is None else ops.clip(g, -value, value)
               for g in grads]
    return [(g, v) for g, (_, v) in zip(grads, pairs)]

  keras_optimizers.clip_after_all_reduce(optimizer, all_reduce_then_clip)


def _over_expert_group(context, replica, value):
  """`value` (this replica's sums of squares of its experts) summed over
  its expert group, on the replica's head."""
  if replica is None or context.groups.expert == 1:
    return value
  launcher = context.launchers.all_to_all(replica)
  return tf.reshape(launcher.all_reduce(tf.reshape(value, [-1])),
                    tf.shape(value))
