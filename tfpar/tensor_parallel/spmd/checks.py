"""What `TensorParallelStrategy(..., spmd=True)` does not run (yet): each
raises a `ValueError` naming the setting before any work is done."""

import keras
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel.spmd import dropout as dropout_lib
from tfpar.tensor_parallel.spmd import sequence

_RULE = ("spmd=True supports models of Dense, EinsumDense, "
         "MultiHeadAttention, Embedding, ReversibleEmbedding and keras-hub "
         "attention layers, each tensor group on one worker, ZeRO stages "
         "1-2 on one host")


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
            f"TensorParallelStrategy(spmd=True) cannot split layer "
            f"{layer.name!r} ({type(layer).__name__}) by heads with its "
            f"dropout sublayer {unknown.name!r} (rate={unknown.rate!r}): "
            f"tfpar draws one device's mask only for the attention dropout "
            f"it knows (spmd/dropout.py); {_RULE}. Use rate 0 there or "
            f"spmd=False.")
    noise = getattr(layer, "noise_shape", None)
    if type(layer) is keras.layers.Dropout and layer.rate and noise:
      for axis, what in split_axes.items():
        if axis < len(noise) and noise[axis] not in (None, 1):
          raise ValueError(
              f"TensorParallelStrategy(spmd=True) splits axis {axis} (the "
              f"{what}) of layer {layer.name!r}'s input over devices; its "
              f"noise_shape={tuple(noise)!r} fixes that axis to "
              f"{noise[axis]}, but only None (the whole axis) or 1 "
              f"(broadcast) name a mask one device would draw; {_RULE}. "
              f"Use None or 1 there.")


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


def check_optimizer(optimizer, mesh=None):
  """Refuses optimizer settings the SPMD step does not reproduce.

  Args:
    optimizer: the model's optimizer (or None).
    mesh: the strategy's `tfpar.Mesh` (None: the one ZeRO's strategy has).

  Raises:
    ValueError: ZeRO settings `check_zero` refuses (also on a
      LossScaleOptimizer's inner optimizer).
  """
  if optimizer is None:
    return
  inner = getattr(optimizer, "inner_optimizer", None)
  if inner is not None:  # Loss scaling (mixed_float16): its optimizer.
    check_optimizer(inner, mesh)
  state = getattr(optimizer, "_tfpar_zero", None)
  if state is not None:
    check_zero(state.stage, state.offload,
               mesh or state.strategy.extended.mesh)


def check_zero(stage, offload, mesh):
  """Refuses `tfpar.ZeRO` settings not built under SPMD.

  Args:
    stage: ZeRO's stage.
    offload: ZeRO's offload.
    mesh: the strategy's `tfpar.Mesh`.

  Raises:
    ValueError: stage 3 (its weight slices are gathered inside the layers'
      calls, which SPMD replaces per device), CPU offload (not built), or
      a multi-worker mesh (ZeRO's whole-state saving gathers one column).
  """
  rule = ("TensorParallelStrategy(spmd=True) runs tfpar.ZeRO stages 1 and "
          "2 without offload, on one host")
  if stage == 3:
    raise ValueError(
        f"{rule}. Received: ZeRO(stage=3): stage 3 gathers weight slices "
        f"inside the layers' calls, and SPMD's split layers read their "
        f"device's shard there; use stage 1 or 2, or spmd=False.")
  if offload is not None:
    raise ValueError(
        f"{rule}. Received: ZeRO(offload={offload!r}); use offload=None, "
        f"or spmd=False.")
  if mesh.is_multi_worker:
    raise ValueError(
        f"{rule}. Received: a mesh over {mesh.cluster.num_workers} "
        f"workers with ZeRO(stage={stage}); use spmd=False there.")
