"""Sequence parallelism inside keras-hub's transformer blocks (SPMD).

A keras-hub block (GPT-2's and BERT's, Llama's, Mistral's, Qwen2's,
Gemma's) is one node of the model's graph; its LayerNorms, dropout and
residual adds are plain operations of its own `call`. Under sequence
parallelism the block runs that `call` on the device's slice of the
sequence, as Megatron's blocks do:

* the slices inside it are recognised by what computed them
  (`slice_graph.py`): a position-wise op of slices is a slice;
* its attention layer gathers the sequence for its projections
  (`Slices.gather_arguments`; backward: reduce-scatter) and computes
  rotary embeddings and scores over the whole sequence, so positions are
  those of one device; its row-parallel projections (attention output,
  MLP output) reduce-scatter;
* the attention mask, which the block computes from its input's length,
  is computed from a stand-in of the whole sequence's shape
  (`_compat/keras_hub_blocks.py`);
* replicated weights applied to slices (the norms') get partial
  gradients, summed over the tensor group before the data all-reduce.

The block's output must come out a slice (checked at trace time).
`PositionEmbedding` nodes (GPT-2, BERT) take their slice's positions.
"""

import tensorflow as tf

from tfpar._compat import keras_hub_blocks
from tfpar._compat import keras_layers
from tfpar._compat.keras_modules import tree
from tfpar.engine.per_device import collectives

AXIS = 1


def _is_split(layer, split):
  if split is None:
    return getattr(layer, "_tfpar_layer_layout", None) is not None
  return id(layer) in split


def _split_layers(layer, split=None):
  """The split layers in `layer` (itself excluded), with their sublayers
  (`split`: ids of the split layers; default: those already split)."""
  found = []
  for sub in keras_layers.flatten_layers(layer, include_self=False):
    if _is_split(sub, split):
      found.extend(keras_layers.flatten_layers(sub, include_self=True))
  return found


def containers(model, split_layers=None):
  """The layers of `model`'s graph that hold split layers without being
  split themselves (keras-hub blocks, or anything else that would need the
  sequence whole inside).

  Args:
    model: a functional or Sequential model.
    split_layers: the layers to be split (default: those already split).
  """
  split = None if split_layers is None else {id(l) for l in split_layers}
  return [layer for layer in getattr(model, "layers", ())
          if not _is_split(layer, split) and _split_layers(layer, split)]


def is_block(layer):
  """Whether `layer` is a keras-hub block run on sequence slices."""
  return keras_hub_blocks.block_class(layer) is not None


def is_position_embedding(operation):
  """Whether `operation` is keras-hub's `PositionEmbedding`."""
  cls = type(operation)
  return cls.__name__ == "PositionEmbedding" and cls.__module__.startswith(
      "keras_hub.")


def install(block, slices):
  """Prepares keras-hub `block` to run on sequence slices: its attention
  mask from the whole sequence's length, its replicated weights outside
  split layers summed over the tensor group (they see slices).

  Args:
    block: a layer `is_block` accepts.
    slices: the strategy's `sequence.Slices`.
  """
  t = slices.groups.tensor_size

  def whole_shape(x):
    if not slices.is_sliced(x):
      return x
    shape = tf.shape(x)
    # Only its shape is read: [batch, the whole sequence, 1].
    return tf.zeros(tf.stack([shape[0], shape[AXIS] * t, 1]), x.dtype)

  keras_hub_blocks.wrap_attention_mask(block, whole_shape)
  split = _split_layers(block)
  split_paths = {w.path for layer in split for w in layer.weights}
  for layer in keras_layers.flatten_layers(block, include_self=False):
    if not any(layer is s for s in split):
      slices.mark_weights([w for w in layer.trainable_weights
                           if w.path not in split_paths])


def run(block, call, args, kwargs, slices):
  """`block`'s call on sequence slices; its output marked as a slice.

  Args:
    block: the block (`install`ed).
    call: its call (the graph's).
    args: positional arguments (the first: a slice).
    kwargs: keyword arguments (padding masks stay whole).
    slices: the strategy's `sequence.Slices`.

  Raises:
    ValueError: the block's output is not a slice (something in it mixed
      positions outside attention).
  """
  outputs = call(*args, **kwargs)
  for y in tree.flatten(outputs):
    if tf.is_tensor(y) and not slices.is_sliced(y):
      raise ValueError(
          f"TensorParallelStrategy(sequence_parallel=True) runs "
          f"keras-hub block {block.name!r} ({type(block).__name__}) on "
          f"sequence slices, but its output {y.name} (shape {y.shape}) is "
          f"not computed position by position from them: something in the "
          f"block mixes positions outside attention. Sequence parallelism "
          f"needs blocks whose only cross-position operation is "
          f"attention; use sequence_parallel=False.")
  return outputs


def position_embedding(layer, call, args, kwargs, slices):
  """A `PositionEmbedding` of a sequence slice: this device's positions
  (its table's gradient covers them only: summed over the group)."""
  inputs, rest = args[0], args[1:]
  if rest or kwargs.get("positions") is not None:  # Positions given.
    return call(slices.for_replicated(inputs, layer.name), *rest, **kwargs)
  length = inputs.shape[AXIS]
  if length is None:  # A sequence length known only when the step runs.
    length = tf.shape(inputs)[AXIS]
  start = collectives.current_slot().tensor_index * length
  kwargs["start_index"] = kwargs.get("start_index", 0) + start
  outputs = call(inputs, **kwargs)
  slices.mark_weights(layer.trainable_weights)
  return slices.mark(outputs)
