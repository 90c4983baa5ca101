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

So, where the layer's call repeats the heads, the first device sharing a
head (its owner) computes the head and repeats it for all the query heads
that share it, as one device does, and hands each other device its query
heads' copies (`comm.hand_out`); their gradients come back to the owner,
where the repeat's own gradient adds them. The other devices compute no
key/value projection. Elsewhere (Gemma, whose attention contracts the
grouped query heads in one einsum), and under ZeRO-3, every sharing device
computes the head.
"""

import dataclasses

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
_HEAD_AXIS = 2  # [batch, sequence, heads, head_dim]


@dataclasses.dataclass(frozen=True)
class Sharing:
  """How the devices of a tensor group share key/value heads.

  Attributes:
    sharers: devices per key/value head (consecutive devices).
    groups: query heads per key/value head (one device's repeat count).
    local_heads: query heads per device.
    handed_out: whether owners hand the repeated heads out (the layer's
      call repeats them) rather than every sharing device computing them.
  """
  sharers: int
  groups: int
  local_heads: int
  handed_out: bool

  @property
  def key_value_heads_seen(self):
    """Key/value heads the layer's call sees on a device: its query heads'
    copies when they are handed out (repeated already), else its one."""
    return self.local_heads if self.handed_out else 1

  def head(self, index):
    """The key/value head device `index` uses."""
    return index // self.sharers

  def computes(self, index):
    """Whether device `index` computes its key/value head's projections."""
    return not self.handed_out or index % self.sharers == 0

  def receivers(self, index):
    """The devices the owner `index` hands its head out to."""
    if not self.handed_out or index % self.sharers:
      return ()
    return tuple(range(index + 1, index + self.sharers))


def sharing_of(layer, family, tensor_size, per_device, rerun=False):
  """The `Sharing` of an attention layer split by heads, or None when each
  device has key/value heads of its own.

  Args:
    layer: the attention layer.
    family: its `families.AttentionFamily`.
    tensor_size: the size of its tensor group.
    per_device: key/value heads per device
      (`families.key_value_heads_per_device`).
    rerun: whether its key/value projections run again in the backward
      pass outside the layer's call (ZeRO-3), where nothing can be handed
      out: then every sharing device computes its head.
  """
  query, key_value = family.head_counts(layer)
  if per_device != 1 or key_value >= tensor_size:
    return None
  return Sharing(tensor_size // key_value, query // key_value,
                 query // tensor_size,
                 rotary_of(layer) is not None and not rerun)


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


def placeholder(dense, x):
  """Zeros shaped as one head of `dense` on `x`: what a device that
  receives its key/value heads gets from the projection (the layer's call
  still runs it; its result is replaced before attention)."""
  inputs, kernel_letters, output = layouts.einsum_letters(dense.equation)
  letter = layouts.einsum_split_letter(dense.equation, styles.COLUMN)
  dynamic = tf.shape(x)
  dims = [size if size is not None else dynamic[i]
          for i, size in enumerate(x.shape)]
  leading = len(dims) - len(inputs)  # Dimensions under a '...'.
  sizes = dict(zip(inputs, dims[leading:]))
  for i, name in enumerate(kernel_letters):
    sizes.setdefault(name, dense.kernel.shape[i])
  sizes[letter] = 1
  return tf.zeros(dims[:leading] + [sizes[name] for name in output],
                  dense.compute_dtype)


class Exchange:
  """Hands the repeated key/value heads from their owners to the other
  devices sharing them, inside the replay of one attention layer
  (`heads.replay` runs the layer's call once per device, in device order,
  so an owner runs before the devices it hands out to).

  The owner repeats the value projection's output and the rotated key (the
  layer's rotary embedding, whose `call` is wrapped, takes the key
  projection's output) for every query head sharing them and keeps its own
  query heads' copies; the layer's own repeat is then by 1. The value is
  handed out from its projection's `call`, which ZeRO-3 runs again in the
  backward pass outside the replay: under ZeRO-3 nothing is handed out
  (`sharing_of`'s `rerun`).

  Args:
    rotary: the layer's rotary embedding layer (`rotary_of`).
  """

  def __init__(self, rotary):
    self._sharing = self._index = self._key = None
    self._received, self._sent = {}, {}
    original = rotary.call

    def call(inputs, *args, **kwargs):
      if self._index is not None and inputs is self._key:
        self._key = None
        return self._hand("key", lambda: original(inputs, *args, **kwargs))
      return original(inputs, *args, **kwargs)
    object.__setattr__(rotary, "call", call)

  def projected(self, role, y):
    """The key or value the layer gets from its projection's output `y`
    (on a receiving device, a placeholder): the value as handed out, the
    key as it is before its rotary embedding hands it out."""
    if self._index is None:
      return y
    if role == "key":
      self._key = y
      return y
    return self._hand("value", lambda: y)

  def run(self, fn, sharing, index, received):
    """`fn()` (the layer's call on device `index`) handing out or taking
    the key/value heads.

    Args:
      fn: runs the layer's call.
      sharing: the layer's `Sharing` (with `handed_out`).
      index: the device's position in the tensor group.
      received: on a receiving device, its [key, value] heads as handed
        out; else empty.

    Returns:
      (fn's result, [key, value] pieces for each of
      `sharing.receivers(index)`, flattened).
    """
    self._sharing, self._index = sharing, index
    self._received, self._sent = dict(zip(("key", "value"), received)), {}
    try:
      result = fn()
      if self._received or len(self._sent) != 2 * bool(
          sharing.receivers(index)):
        raise ValueError(
            f"An attention layer's call did not rotate its key projection's "
            f"output with its rotary embedding layer and take the value "
            f"projection's output as it is, which tfpar relies on to compute "
            f"each key/value head shared by {sharing.sharers} devices once "
            f"(tfpar/tensor_parallel/shared_heads.py).")
      return result, [t for pair in zip(self._sent.get("key", ()),
                                        self._sent.get("value", ()))
                      for t in pair]
    finally:
      self._index = self._key = None
      self._received, self._sent = {}, {}

  def _hand(self, role, compute):
    sharing = self._sharing
    if not sharing.computes(self._index):
      return self._received.pop(role)
    # Repeated for every query head sharing it, as one device's call does,
    # so that backward the repeat's gradient adds theirs in the compute
    # dtype before the head's projection takes its kernel gradient once.
    everyone = keras.ops.repeat(compute(), sharing.groups, axis=_HEAD_AXIS)
    pieces = tf.split(everyone, sharing.sharers, axis=_HEAD_AXIS)
    self._sent[role] = pieces[1:]
    return pieces[0]
