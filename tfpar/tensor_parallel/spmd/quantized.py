"""int8 layers under SPMD: Keras's own quantized calls on each device's
shard.

A column-parallel int8 projection (and a vocabulary-split int8 embedding,
`embeddings.py`) runs Keras's `quantized_call` on its shard as it is: its
inputs are whole, so their quantization scale is one device's, and its
kernel scale is split with its output channels.

A row-parallel one holds part of its input features. Keras's int8 call
quantizes its inputs per row by their largest magnitude over the input
features (`AbsMaxQuantizer`), so each device takes the maximum over the
whole group (`collectives.group_max`) and quantizes its part with the
scale one device computes; its partial product (the int8 product
de-scaled, plus a LoRA factor's partial term) is summed over the group,
then the whole bias and the activation apply, once.
"""

import tensorflow as tf

from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles


def is_quantized(layer):
  return getattr(layer, "quantization_mode", None) is not None


class _WholeRange:
  """A layer's input quantizer fed the whole input's range: the maximum
  magnitude over the group is appended along the last reduced axis, so
  the quantizer's own scale is one device's; the appended values are cut
  off its output."""

  def __init__(self, quantizer, memo, name):
    self._quantizer = quantizer
    self._memo = memo
    self._name = name

  def __call__(self, x, axis=None, to_numpy=False):
    del to_numpy
    rank = x.shape.rank
    axes = sorted(a % rank for a in (axis if isinstance(axis, (tuple, list))
                                     else (-1 if axis is None else axis,)))
    local = tf.reduce_max(tf.abs(x), axis=axes, keepdims=True)
    whole = collectives.group_max(self._memo.groups, local, self._name)
    last = axes[-1]
    shape = tf.tensor_scatter_nd_update(tf.shape(x), [[last]], [1])
    extended = tf.concat([x, tf.broadcast_to(whole, shape)], last)
    quantized, scale = self._quantizer(extended, axis=axis)
    begin = [0] * rank
    size = tf.tensor_scatter_nd_update(tf.shape(x), [[last]],
                                       [tf.shape(x)[last]])
    return tf.slice(quantized, begin, size), scale


def row_partial(layer, memo, inputs):
  """This device's partial sum of a row-parallel int8 `layer` on its
  input features: Keras's int8 call with the whole input's quantization
  scale, without the bias and activation (added once, after the sum)."""
  saved = {name: getattr(layer, name)
           for name in ("inputs_quantizer", "bias", "activation")}
  changed = {"bias": None, "activation": None}
  if saved["inputs_quantizer"] is not None:
    changed["inputs_quantizer"] = _WholeRange(saved["inputs_quantizer"],
                                              memo, layer.name)
  try:  # Replica threads trace one at a time.
    for name, value in changed.items():
      object.__setattr__(layer, name, value)
    return type(layer).quantized_call(layer, inputs)
  finally:
    for name, value in saved.items():
      object.__setattr__(layer, name, value)


def shared_head(dense, x, head):
  """Head `head` of an int8 key or value projection kept whole (fewer
  key/value heads than devices): Keras's int8 call on every head, that
  head's output taken (the heads are few)."""
  y = type(dense).quantized_call(dense, x)
  axis = layouts.activation_split_axis(dense, styles.COLUMN) % y.shape.rank
  index = [slice(None)] * y.shape.rank
  index[axis] = slice(head, head + 1)
  return y[tuple(index)]
