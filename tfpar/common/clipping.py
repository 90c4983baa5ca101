"""Gradient clipping as one device clips: after the gradients are summed
over replicas, and by the norm of a whole weight held in pieces (tensor
shards, ZeRO slices).

Keras clips each replica's own gradient before its optimizer sums them
over replicas (`_clip_gradients` runs before `_all_reduce_sum_gradients`),
so under stock `MirroredStrategy` a replica's half-batch gradient is
clipped by its own norm: not the model one device trains (measured on
tp_common's MLP, Adam with `clipnorm=0.05`, float32: 1.1e-2 in losses over
24 steps on 2 replicas). TensorFlow's team called clipping before the sum
"usually wrong" and had tf.keras refuse clipping under a strategy
(tensorflow/tensorflow#33929); Keras 3 clips silently.
"""

from keras import ops

from tfpar._compat import keras_optimizers
from tfpar._compat.keras_modules import base_optimizer


def clip_by_norm_of(grad, square_sum, clipnorm):
  """Keras's `_clip_by_norm` of `grad`, with the norm given as the sum of
  squares of the whole weight (`grad` may be a shard or slice of it).

  Args:
    grad: the gradient (or part of it) to scale.
    square_sum: the sum of squares of the whole gradient.
    clipnorm: the optimizer's `clipnorm`.

  Example:

  >>> from tfpar.common.clipping import clip_by_norm_of
  >>> round(float(clip_by_norm_of(4.0, 25.0, 1.0)), 6)  # norm 5: scaled by 1/5
  0.8
  """
  positive = square_sum > 0
  norm = ops.where(positive, ops.sqrt(ops.where(positive, square_sum, 1.0)),
                   square_sum)
  return ops.multiply(grad, clipnorm) / ops.maximum(norm, clipnorm)


def clips(optimizer):
  """Whether `optimizer` (or the inner optimizer of a loss-scale one)
  clips gradients: a positive `clipnorm`, `global_clipnorm` or `clipvalue`,
  as Keras's `_clip_gradients` reads them.

  Args:
    optimizer: a Keras optimizer.

  Example:

  >>> import keras
  >>> from tfpar.common.clipping import clips
  >>> clips(keras.optimizers.SGD(global_clipnorm=1.0))
  True
  >>> clips(keras.optimizers.Adam())
  False
  """
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  return any(value and value > 0 for value in (
      inner.clipnorm, inner.global_clipnorm, inner.clipvalue))


def clip_after_all_reduce(optimizer, pieces_of=dict):
  """Makes `optimizer` clip its gradients after summing them over replicas,
  each weight by its whole norm (with `clipnorm`), as one device clips.

  Args:
    optimizer: a Keras optimizer (the inner one of a loss-scale optimizer
      holds the clipping settings and is the one changed), not yet built.
    pieces_of: `pieces_of()` when a step is traced: {id(variable storage):
      the key of the whole weight it is a piece of}, for weights held in
      pieces; default none.

  Example:

  >>> import keras
  >>> from tfpar.common.clipping import clip_after_all_reduce
  >>> optimizer = keras.optimizers.SGD(clipnorm=1.0)
  >>> clip_after_all_reduce(optimizer)
  >>> optimizer._clip_gradients([3.0])  # Keras's own clipping: now none.
  [3.0]
  """
  optimizer = getattr(optimizer, "inner_optimizer", optimizer)
  if not clips(optimizer) or getattr(optimizer, "_tfpar_clips_after_sum",
                                     False):
    return
  object.__setattr__(optimizer, "_tfpar_clips_after_sum", True)
  all_reduce = keras_optimizers.all_reduce_sum_gradients(optimizer)

  def all_reduce_then_clip(grads_and_vars):
    pairs = list(all_reduce(grads_and_vars))
    grads = [g for g, _ in pairs]
    if optimizer.clipnorm and optimizer.clipnorm > 0:
      pieces = pieces_of()
      keys = [pieces.get(id(v), id(v)) for _, v in pairs]
      sums = {}
      for key, grad in zip(keys, grads):
        if grad is not None:
          sums[key] = sums.get(key, 0.0) + ops.sum(ops.square(grad))
      grads = [None if g is None else clip_by_norm_of(g, sums[k],
                                                       optimizer.clipnorm)
               for g, k in zip(grads, keys)]
    elif optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
      grads = base_optimizer.clip_by_global_norm(grads,
                                                 optimizer.global_clipnorm)
    elif optimizer.clipvalue and optimizer.clipvalue > 0:
      v = optimizer.clipvalue
      grads = [None if g is None else ops.clip(g, -v, v) for g in grads]
    return [(g, v) for g, (_, v) in zip(grads, pairs)]

  keras_optimizers.clip_after_all_reduce(optimizer, all_reduce_then_clip)
