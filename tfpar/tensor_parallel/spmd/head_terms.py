"""Per-head terms of an attention split by heads (SPMD): the device's
heads of call arguments over all heads (Falcon's alibi), and of a bias a
sublayer computes from the scores' shape (Bloom's `AlibiBias`,
`families.HEAD_BIAS_LAYERS`)."""

from keras import ops

from tfpar.engine.per_device import collectives


def _device_index():
  slot = collectives.current_slot()
  return 0 if slot is None else slot.tensor_index


def _device_heads(x, axis, tensor_size):
  """This device's heads of a tensor over all heads along `axis`."""
  return ops.split(x, tensor_size, axis=axis)[_device_index()]


def device_heads_of_arguments(args, kwargs, arguments, tensor_size):
  """The call's arguments with this device's heads of those carrying a
  per-head term.

  Args:
    args, kwargs: the attention layer's call arguments.
    arguments: `attention_trace.Attention.head_arguments`.
    tensor_size: the mesh's tensor size.
  """
  args, kwargs = list(args), dict(kwargs)
  for where, axis in arguments:
    if isinstance(where, int) and where < len(args):
      args[where] = _device_heads(args[where], axis, tensor_size)
    elif where in kwargs and kwargs[where] is not None:
      kwargs[where] = _device_heads(kwargs[where], axis, tensor_size)
  return tuple(args), kwargs


def head_bias(layer, memo, heads):
  """A sublayer adding a per-head bias computed from the scores' shape
  (`families.HEAD_BIAS_LAYERS`, scores [batch, heads, query, key]) on one
  device's heads: the bias of all heads, from a stand-in of their shape,
  then this device's part added."""
  original = type(layer).call.__get__(layer)

  def call(scores, *args, **kwargs):
    stand_in = ops.zeros((1, heads, 1, ops.shape(scores)[-1]), scores.dtype)
    bias = original(stand_in, *args, **kwargs)
    return ops.add(scores, _device_heads(bias, -3, memo.groups.tensor_size))
  return call
