"""Key/value heads shared by several devices of a tensor group.

With fewer key/value heads than the tensor size (grouped-query attention,
`tensor % key_value_heads == 0`) each key/value head serves the query heads
of `tensor // key_value_heads` devices. Megatron and vLLM give every such
device a copy of the head's projection; its kernel gradient is then one
product per device, summed over the devices. One device computes the head
once, repeats it for its query heads (`ops.repeat` in keras-hub's Llama,
Mistral and Qwen attention) and, backward, adds the repeated heads'
gradients in the compute dtype before one kernel-gradient product: under
`mixed_bfloat16` the two round differently (up to 7x stock Mirrored's
loss spread after 10 steps of Adam on Llama with 2 key/value heads on
tensor 4).

So each device computes the key/value head its query heads use from the
whole projection (`head_slice`); the first device sharing a head takes the
head's kernel gradient from all its sharers' query-head gradients, summed
in the compute dtype as one device's repeat sums them
(`spmd/layers._shared_head`, `engine/per_device/collectives.summed_by_first_sharer`).
Where the layer's call rotates the key before repeating it (`rotary_of`),
that sum comes after the rotation, as on one device.
"""

import keras
import tensorflow as tf

from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel import styles

# Attention classes whose call rotates its key projection's output with a
# rotary embedding layer (the attribute named here), then repeats key and
# value for its query heads (`ops.repeat(key, groups, axis=2)`).
_REPEATING = {"LlamaAttention": "rotary_embedding_layer",
              "CachedMistralAttention": "rotary_embedding_layer",
              "QwenAttention": "rotary_embedding_layer"}


def rotary_of(layer):
  """The rotary embedding layer of an attention layer whose call repeats
  its key/value heads (`_REPEATING`), or None."""
  for cls in type(layer).__mro__:
    name = _REPEATING.get(cls.__name__)
    if name and cls.__module__.startswith("keras_hub."):
      return getattr(layer, name, None)
  return None


def _take_head(variable, head, axis):
  """Head `head` of `variable` along `axis`, kept as an axis of size 1.

  A strided slice, not a gather: a gather along axis 0 would give the
  variable a sparse gradient, which Adam updates differently."""
  index = [slice(None)] * len(variable.shape)
  index[axis] = slice(head, head + 1)
  return tf.convert_to_tensor(variable)[tuple(index)]


def head_slice(dense, x, head, float32=False):
  """`dense` on `x` restricted to head `head` of its whole kernel; with
  `float32`, as `layers.project` computes (its input may be float32).

  Args:
    dense: a key or value `EinsumDense` whose kernel is kept whole.
    x: its input.
    head: the key/value head.
    float32: take the product in float32 (float32 partial sums).
  """
  equation = dense.equation
  letter = layouts.einsum_split_letter(equation, styles.COLUMN)
  _, kernel_letters, output = layouts.einsum_letters(equation)
  axis = kernel_letters.index(letter)
  compute = dense.compute_dtype
  kernel = keras.ops.cast(_take_head(dense.kernel, head, axis), compute)
  if float32 and compute in ("bfloat16", "float16"):
    y = keras.ops.cast(rounding.widened_product(x, kernel, equation),
                       compute)
  else:
    y = keras.ops.einsum(equation, x, kernel)
  if dense.bias is not None:
    bias = dense.bias
    if letter in (dense.bias_axes or ""):
      bias_axis = len(bias.shape) + output.index(letter) - len(output)
      bias = _take_head(bias, head, bias_axis)
    y = rounding.add_bias(y, bias, dense.bias.shape)
  return y
