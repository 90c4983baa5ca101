"""What `TensorParallelStrategy(..., spmd=True)` does not run yet: each
raises a `ValueError` naming the setting before any work is done."""

import keras

from tfpar._compat import keras_layers
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles

_RULE = ("spmd=True supports models of Dense, EinsumDense, "
         "MultiHeadAttention and Embedding layers on one host, trained "
         "without gradient clipping, accumulation or ZeRO, and dropout only "
         "in replicated regions")


def check_strategy(mesh):
  """Refuses meshes the SPMD strategy does not run on.

  Args:
    mesh: the `tfpar.Mesh`.

  Raises:
    ValueError: a multi-worker mesh.
  """
  if mesh.cluster is not None:
    raise ValueError(
        f"TensorParallelStrategy(spmd=True) runs on one host; this mesh "
        f"spans the TF_CONFIG cluster {mesh.cluster.cluster_spec}. "
        f"{_RULE}. Use spmd=False across workers.")


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


def check_layouts(layer_layouts):
  """Refuses layouts with no SPMD computation.

  Args:
    layer_layouts: the resolved `LayerLayout`s of the split layers.

  Raises:
    ValueError: keras-hub attention, a ReversibleEmbedding.
  """
  for layout in layer_layouts:
    layer = layout.layer
    if layout.kind == layouts.HEADS:
      raise ValueError(
          f"TensorParallelStrategy(spmd=True) cannot split layer "
          f"{layer.name!r} ({type(layer).__name__}): keras-hub attention "
          f"layers need per-device attributes; {_RULE}. Use spmd=False, or "
          f"give its weights tfpar.Replicate().")
    if layout.kind == layouts.EMBEDDING and (
        type(layer) is not keras.layers.Embedding):
      raise ValueError(
          f"TensorParallelStrategy(spmd=True) splits keras.layers.Embedding "
          f"tables only; layer {layer.name!r} is a {type(layer).__name__}; "
          f"{_RULE}. Use spmd=False, or give it tfpar.Replicate().")
    if layout.kind not in (layouts.DENSE, layouts.EINSUM, layouts.ATTENTION,
                           layouts.EMBEDDING) or not isinstance(
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
    ValueError: clipping, gradient accumulation, ZeRO (also on a
      LossScaleOptimizer's inner optimizer).
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
  for name in ("clipnorm", "global_clipnorm", "clipvalue",
               "gradient_accumulation_steps"):
    value = getattr(optimizer, name, None)
    if value:
      raise ValueError(
          f"TensorParallelStrategy(spmd=True) does not support optimizer "
          f"setting {name}={value!r} yet (each device holds only its "
          f"shards' gradients); {_RULE}.")
