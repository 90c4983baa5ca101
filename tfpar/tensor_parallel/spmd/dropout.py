"""Dropout under SPMD, drawing exactly the masks one device draws.

Every trace of a step runs with the same `SeedGenerator` state (its state
variable is mirrored on every device and advances identically), so a stock
`Dropout` would draw the same mask on every device of a tensor group for
whatever part of the tensor that device holds: its heads' masks would
repeat across the group, its sequence slice's too. Here each affected
`Dropout` draws the mask its data replica draws for the whole tensor (the
same seed, the replica's whole shape: all heads, the whole sequence) and
keeps its own part of it:

* split attention's dropout (keras `MultiHeadAttention`'s scores, the
  keras-hub families' attention dropout, `_HEAD_AXES`): this device's
  query heads;
* with sequence parallelism, a `Dropout` applied to a sequence slice:
  this device's slice.

The mask is Keras's own draw (`keras.random.dropout` of ones of the whole
noise shape, one `SeedGenerator` step as the stock layer), so kept values
are `x * scale` as one device computes them and the seed state ends as
one device's. The cost: every device draws its replica's whole mask (the RNG
work of the whole tensor, and a transient whole mask: for attention, the
scores of all heads).

Data replicas draw as under `tfpar.DataParallelStrategy` and stock
`MirroredStrategy`: each its own batch's mask from the same seed state
(so they draw the same mask for different examples). One device's mask
for the global batch would cost every device the RNG work of all
replicas' batches.
"""

import keras
import tensorflow as tf

from tfpar._compat import keras_attention
from tfpar._compat import keras_hub_names
from tfpar._compat import keras_layers
from tfpar._compat import spmd_run
from tfpar._compat.checks import member
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import traced_families
from tfpar.tensor_parallel.spmd import sequence

# {family class name: axes of its attention Dropout's input holding the
# query heads, key/value head major}. MultiHeadAttention (and subclasses
# using its `_compute_attention`) drop scores [batch..., heads, target...,
# source...]: `attention_dropout` finds the heads axis from its attention
# axes.
_HEAD_AXES = {
    "LlamaAttention": (-2,),  # [batch, sequence, heads, dim]
    "QwenAttention": (-2,),
    "CachedMistralAttention": (-2,),
    "CachedGemmaAttention": (-4, -3),  # [batch, kv heads, groups, t, s]
    "CachedGemma3Attention": (-4, -3),
}


class _HeadSplit:
  """The split heads of an attention layer's dropout input.

  Args:
    axes: the (contiguous, negative) axes holding the query heads.
    whole: their whole sizes (one device's).
  """

  def __init__(self, axes, whole):
    self.axes = axes
    self.whole = whole


def attention_dropout(layer):
  """(Dropout sublayer, `_HeadSplit`) of an attention layer split by
  heads, or (None, None) when it has no dropout.

  Args:
    layer: a built `keras.layers.MultiHeadAttention` or keras-hub
      attention layer of `families.FAMILIES`.
  """
  purpose = "drawing split attention's dropout as one device"
  if isinstance(layer, keras.layers.MultiHeadAttention):
    dropout = member(layer, keras_attention.DROPOUT, purpose)
    axes = member(layer, keras_attention.ATTENTION_AXES, purpose)
    split = _HeadSplit((-(1 + 2 * len(axes)),), (member(
        layer, keras_attention.QUERY_HEADS, purpose),))
  else:
    family = families.family_of(layer)
    if isinstance(family, traced_families.TracedFamily):
      return None, None  # Refused with a dropout rate (builtin.py).
    if family.class_name not in _HEAD_AXES:
      raise ValueError(
          f"Tensor parallelism does not know where layer "
          f"{layer.name!r} ({type(layer).__name__}) applies its attention "
          f"dropout: every attention family must have an entry in "
          f"tfpar/tensor_parallel/spmd/dropout.py's _HEAD_AXES.")
    axes = _HEAD_AXES[family.class_name]
    dropout = member(layer, keras_hub_names.ATTENTION_DROPOUT[
        family.class_name], purpose)
    query, key_value = family.head_counts(layer)
    split = _HeadSplit(axes, (query,) if len(axes) == 1 else (
        key_value, query // key_value))
  if not isinstance(dropout, keras.layers.Dropout) or not dropout.rate:
    return None, None
  return dropout, split


def unknown_attention_dropout(layer):
  """A Dropout sublayer with rate > 0 of an attention layer that
  `attention_dropout` does not know, or that is not a plain `Dropout` (it
  would act on split heads with a stock draw), or None."""
  known, _ = attention_dropout(layer)
  for sub in keras_layers.flatten_layers(layer, include_self=False):
    if isinstance(sub, keras.layers.Dropout) and sub.rate and (
        sub is not known or type(sub) is not keras.layers.Dropout):
      return sub
  return None


def install(model, layer_layouts, memo):
  """Makes `model`'s `Dropout` layers draw one device's masks where a
  device holds part of their input (idempotent).

  Args:
    model: the model being sharded.
    layer_layouts: its resolved `LayerLayout`s.
    memo: the strategy's `Memo` (tensor groups, sequence slices).
  """
  heads = {}
  for layout in layer_layouts:
    if layout.kind in (layouts.ATTENTION, layouts.HEADS):
      dropout, split = attention_dropout(layout.layer)
      if dropout is not None:
        heads[id(dropout)] = split
  for layer in keras_layers.flatten_layers(model, include_self=False):
    if (type(layer) is not keras.layers.Dropout or not layer.rate or
        getattr(layer, "_tfpar_spmd_dropout", False)):
      continue
    split = heads.get(id(layer))
    if split is None and memo.slices is None:
      continue  # Replicated: the stock draw is the replica's.
    object.__setattr__(layer, "call", _call(layer, split, memo))
    object.__setattr__(layer, "_tfpar_spmd_dropout", True)


def _call(layer, heads, memo):
  stock = layer.call

  def call(inputs, training=False):
    slot = collectives.current_slot()
    if (not (training and layer.rate > 0) or slot is None or
        spmd_run.in_symbolic_trace()):
      return stock(inputs, training=training)
    t = memo.groups.tensor_size
    rank = inputs.shape.rank
    splits = []  # (axes, whole sizes or None: local x parts, parts, index)
    if heads is not None:
      splits.append((tuple(a % rank for a in heads.axes), heads.whole, t,
                     slot.tensor_index))
    elif memo.slices is not None and memo.slices.is_sliced(inputs):
      splits.append(((sequence.AXIS,), None, t, slot.tensor_index))
    outputs = one_device_dropout(inputs, layer.rate, layer.noise_shape,
                                 layer.seed_generator, splits)
    if heads is None and splits:  # A slice (read inside keras-hub blocks).
      memo.slices.mark(outputs)
    return outputs
  return call


def one_device_dropout(inputs, rate, noise_shape, seed, splits):
  """Dropout of `inputs`, a part of one device's tensor, with one device's
  mask: drawn for the whole tensor, then this part taken.

  Args:
    inputs: this device's part.
    rate: the dropout rate.
    noise_shape: the layer's `noise_shape` (None: the input's shape); 1
      on a split axis broadcasts the mask there.
    seed: the layer's `SeedGenerator` (advanced once, as by the stock
      layer).
    splits: (axes, whole sizes or None, parts, index) per split: `inputs`
      holds part `index` of `parts` equal parts of the whole along the
      merged `axes` (whole sizes None: `parts` times the local ones).

  Returns:
    `inputs` with one device's mask applied, scaled by 1 / (1 - rate).
  """
  dynamic = tf.shape(inputs)
  local = [inputs.shape[a] if inputs.shape[a] is not None else dynamic[a]
           for a in range(inputs.shape.rank)]
  if noise_shape is not None:
    local = [size if n is None else n for size, n in zip(local, noise_shape)]
  whole = list(local)
  kept = []
  for axes, sizes, parts, index in splits:
    if noise_shape is not None and all(noise_shape[a] == 1 for a in axes):
      continue  # The mask broadcasts along them.
    for a, size in zip(axes, sizes or [None] * len(axes)):
      whole[a] = size if size is not None else local[a] * parts
    kept.append((axes, parts, index))
  mask = keras.random.dropout(tf.ones(tf.stack(whole), inputs.dtype), rate,
                              seed=seed)
  for axes, parts, index in kept:
    mask = _part(mask, axes, parts, index)
  mask = tf.reshape(mask, tf.stack(local))
  return tf.where(mask > 0, inputs * mask, tf.zeros((), inputs.dtype))


def _part(mask, axes, parts, index):
  """Part `index` of `parts` of `mask` along its (contiguous) `axes`
  merged, key/value head major."""
  shape = tf.shape(mask)
  first, last = axes[0], axes[-1] + 1
  merged = tf.concat([shape[:first], [tf.reduce_prod(shape[first:last])],
                      shape[last:]], 0)
  return tf.split(tf.reshape(mask, merged), parts, axis=first)[index]
