"""What tensor parallelism (SPMD, its one design) does not run: each
raises a `ValueError` naming the setting before any work is done."""

import keras

from tfpar._compat import keras_hub_blocks
from tfpar._compat import keras_layers
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel.spmd import blocks
from tfpar.tensor_parallel.spmd import dropout as dropout_lib
from tfpar.tensor_parallel.spmd import sequence

_RULE = ("tensor parallelism supports models of Dense, EinsumDense, "
         "MultiHeadAttention, Embedding, ReversibleEmbedding and keras-hub "
         "attention layers, each tensor group on one worker")


def check_model(model, sequence_parallel):
  """Refuses models the SPMD layers cannot compute exactly.

  Args:
    model: the built model about to be sharded.
    sequence_parallel: the strategy's `sequence_parallel`.

  Raises:
    ValueError: an attention layer with a dropout sublayer tfpar does not
      know (it would act on split heads with a repeating mask); a
      `Dropout` whose `noise_shape` fixes a size on the sequence axis
      under sequence parallelism, which devices split: only None or 1
      name a mask one device would draw.
  """
  split_axes = {sequence.AXIS: "sequence"} if sequence_parallel else {}
  for layer in keras_layers.flatten_layers(model, include_self=False):
    if layer.built and (isinstance(layer, keras.layers.MultiHeadAttention) or
                        families.family_of(layer) is not None):
      unknown = dropout_lib.unknown_attention_dropout(layer)
      if unknown is not None:
        raise ValueError(
            f"Tensor parallelism cannot split layer "
            f"{layer.name!r} ({type(layer).__name__}) by heads with its "
            f"dropout sublayer {unknown.name!r} (rate={unknown.rate!r}): "
            f"tfpar draws one device's mask only for the attention dropout "
            f"it knows (spmd/dropout.py); {_RULE}. Use rate 0 there.")
    noise = getattr(layer, "noise_shape", None)
    if type(layer) is keras.layers.Dropout and layer.rate and noise:
      for axis, what in split_axes.items():
        if axis < len(noise) and noise[axis] not in (None, 1):
          raise ValueError(
              f"Tensor parallelism splits axis {axis} (the "
              f"{what}) of layer {layer.name!r}'s input over devices; its "
              f"noise_shape={tuple(noise)!r} fixes that axis to "
              f"{noise[axis]}, but only None (the whole axis) or 1 "
              f"(broadcast) name a mask one device would draw; {_RULE}. "
              f"Use None or 1 there.")


def check_layouts(layer_layouts, sequence_parallel=False, model=None):
  """Refuses layouts with no SPMD computation.

  Args:
    layer_layouts: the resolved `LayerLayout`s of the split layers.
    sequence_parallel: the strategy's `sequence_parallel`.
    model: the model they belong to (sequence parallelism checks the
      layers of its graph that hold split layers).

  Raises:
    ValueError: with sequence parallelism, split layers inside a layer of
      the model's graph that is not a keras-hub block tfpar runs on
      sequence slices, or a `ReversibleEmbedding(mask_zero=True)` (its
      mask would be the whole sequence's, its output a slice); an
      Embedding subclass other than ReversibleEmbedding; a layout with no
      SPMD computation.
  """
  if sequence_parallel and model is not None:
    for container in blocks.containers(
        model, [layout.layer for layout in layer_layouts]):
      if not blocks.is_block(container):
        raise ValueError(
            f"TensorParallelStrategy(sequence_parallel=True) "
            f"cannot run layer {container.name!r} "
            f"({type(container).__name__}) on sequence slices: it holds "
            f"split layers, and sequence parallelism runs on slices the "
            f"model's graph and the keras-hub blocks it knows "
            f"({', '.join(sorted(keras_hub_blocks.BLOCK_MASKS))}) only; "
            f"{_RULE}. Build the model from those layers' graph (e.g. "
            f"keras.Model(backbone.input, ...)) or use "
            f"sequence_parallel=False.")
  for layout in layer_layouts:
    layer = layout.layer
    reversible = isinstance(layer, keras.layers.ReversibleEmbedding)
    if sequence_parallel and reversible and getattr(layer, "mask_zero",
                                                    False):
      raise ValueError(
          f"TensorParallelStrategy(sequence_parallel=True) "
          f"cannot split layer {layer.name!r} ({type(layer).__name__}) "
          f"with mask_zero=True: its output is a sequence slice, its Keras "
          f"mask the whole sequence's; {_RULE}. Pass a padding mask "
          f"instead, or use sequence_parallel=False.")
    if layout.kind == layouts.EMBEDDING and (
        type(layer) is not keras.layers.Embedding and not reversible):
      raise ValueError(
          f"Tensor parallelism splits keras.layers.Embedding "
          f"and ReversibleEmbedding tables only; layer {layer.name!r} is a "
          f"{type(layer).__name__}; {_RULE}. Give it "
          f"tfpar.Replicate().")
    if layout.kind not in (layouts.DENSE, layouts.EINSUM, layouts.ATTENTION,
                           layouts.HEADS, layouts.EMBEDDING) or not isinstance(
                               layout.style, (styles.ColumnParallel,
                                              styles.RowParallel,
                                              styles.VocabParallel)):
      raise ValueError(
          f"Tensor parallelism cannot split layer "
          f"{layer.name!r} as {layout.kind} {layout.style}; {_RULE}.")
