"""Gradient clipping by the norm of a whole weight held in pieces (tensor
shards, ZeRO slices), as one device clips it."""

from keras import ops


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
