"""What `TensorParallelStrategy(..., spmd=True)` does not run (yet): each
raises a `ValueError` naming the setting before any work is done."""

import keras
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles

_RULE = ("spmd=True supports models of Dense, EinsumDense, "
         "MultiHeadAttention, Embedding, ReversibleEmbedding and keras-hub "
         "attention layers, each tensor group on one worker, without ZeRO, "
         "and dropout only in replicated regions")


def check_strategy(mesh):
  """Refuses meshes the SPMD strategy does not run on.

  Args:
    mesh: the `tfpar.Mesh`.

  Raises:
    ValueError: a multi-worker mesh with a tensor group spanning workers.
  """
  if mesh.cluster is None:
    return
  for group in mesh.replicas:
    tasks = sorted({tf.DeviceSpec.from_string(d).task or 0 for d in group})
    if len(tasks) > 1:
      raise ValueError(
          f"TensorParallelStrategy(spmd=True) needs each tensor group on "
          f"one worker; this mesh's group {list(group)} spans the workers "
          f"(tasks) {tasks}. {_RULE}. Choose a tensor size that divides "
          f"each worker's device count, or use spmd=False.")


def check_model(model, sequence_parallel):
  """Refuses models the SPMD layers cannot compute exactly.

  Args:
    model: the built model about to be sharded.
    sequence_parallel: the strategy's `sequence_parallel`.

  Raises:
    ValueError: dropout in split attention, or
      with sequence parallelism anywhere (every device of a group draws
      the same mask: its heads' or slices' masks would repeat).
  """
  for layer in keras_layers.flatten_layers(model, include_self=False):
    rate = getattr(layer, "dropout", None) if isinstance(
        layer, keras.layers.MultiHeadAttention) else (
            _attention_dropout(layer)
            if families.family_of(layer) is not None else
            getattr(layer, "rate", None)
            if isinstance(layer, keras.layers.Dropout) and sequence_parallel
            else None)
    if rate:
      raise ValueError(
          f"TensorParallelStrategy(spmd=True"
          f"{', sequence_parallel=True' if sequence_parallel else ''}) "
          f"cannot apply layer {layer.name!r}'s dropout={rate!r} on split "
          f"activations: every device of a tensor group draws the same "
          f"mask, so its masks would repeat across heads or sequence "
          f"slices; {_RULE}. Use dropout 0 there or spmd=False.")


def _attention_dropout(layer):
  """The dropout rate of a keras-hub attention layer (its `dropout`, or a
  Dropout sublayer's rate: Mistral keeps it private)."""
  rate = getattr(layer, "dropout", None)
  if isinstance(rate, (int, float)) and rate:
    return rate
  for sub in keras_layers.flatten_layers(layer, include_self=False):
    if isinstance(sub, keras.layers.Dropout) and sub.rate:
      return sub.rate
  return None


def check_layouts(layer_layouts, sequence_parallel=False):
  """Refuses layouts with no SPMD computation.

  Args:
    layer_layouts: the resolved `LayerLayout`s of the split layers.
    sequence_parallel: the strategy's `sequence_parallel`.

  Raises:
    ValueError: with sequence parallelism, keras-hub attention or a
      ReversibleEmbedding (they run inside blocks whose graph is not the
      model's); an Embedding subclass other than ReversibleEmbedding; a
      layout with no SPMD computation.
  """
  for layout in layer_layouts:
    layer = layout.layer
    reversible = isinstance(layer, keras.layers.ReversibleEmbedding)
    if sequence_parallel and (layout.kind == layouts.HEADS or reversible):
      raise ValueError(
          f"TensorParallelStrategy(spmd=True, sequence_parallel=True) "
          f"cannot split layer {layer.name!r} ({type(layer).__name__}): "
          f"sequence parallelism runs the model's own graph operation by "
          f"operation, and keras-hub blocks and tied embeddings compute "
          f"inside layers of their own; {_RULE}. Use "
          f"sequence_parallel=False.")
    if layout.kind == layouts.EMBEDDING and (
        type(layer) is not keras.layers.Embedding and not reversible):
      raise ValueError(
          f"TensorParallelStrategy(spmd=True) splits keras.layers.Embedding "
          f"and ReversibleEmbedding tables only; layer {layer.name!r} is a "
          f"{type(layer).__name__}; {_RULE}. Use spmd=False, or give it "
          f"tfpar.Replicate().")
    if layout.kind not in (layouts.DENSE, layouts.EINSUM, layouts.ATTENTION,
                           layouts.HEADS, layouts.EMBEDDING) or not isinstance(
                               layout.style, (styles.ColumnParallel,
                                              styles.RowParallel,
                                              styles.VocabParallel)):
      raise ValueError(
          f"TensorParallelStrategy(spmd=True) cannot split layer "
          f"{layer.name!r} as {layout.kind} {layout.style}; {_RULE}.")


def check_optimizer(optimizer):
  """Refuses optimizer settings the SPMD step does not reproduce.

  Args:
    optimizer: the model's optimizer (or None).

  Raises:
    ValueError: ZeRO (also on a LossScaleOptimizer's inner optimizer).
  """
  if optimizer is None:
    return
  inner = getattr(optimizer, "inner_optimizer", None)
  if inner is not None:  # Loss scaling (mixed_float16): its optimizer.
    check_optimizer(inner)
  if getattr(optimizer, "_tfpar_zero", None) is not None:
    raise ValueError(
        f"TensorParallelStrategy(spmd=True) does not compose with "
        f"tfpar.ZeRO yet. Received: ZeRO(stage="
        f"{optimizer._tfpar_zero.stage}); {_RULE}.")
