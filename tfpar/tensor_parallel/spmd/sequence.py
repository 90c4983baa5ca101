"""Sequence parallelism under SPMD: position-wise regions on sequence
slices, with reduce-scatter and all-gather among the tensor group.

With `sequence_parallel=True` a row-parallel layer (and a vocabulary-split
embedding) reduce-scatters its [batch, sequence, ...] output: device k of
the group keeps slice k of the sequence. The functional model's
position-wise operations (LayerNormalization, residual adds, elementwise
activations) then run on the slices, and a split layer that needs the
whole sequence (a column-parallel projection, attention) all-gathers it
(its backward reduce-scatters the gradient: Megatron's f). Any other
operation reading a slice gets the whole sequence all-gathered first
(backward: each device keeps its slice of the replicated gradient), and so
do the model's outputs. keras-hub blocks run their own call on slices
(`blocks.py`). Per device, the regions' activations take 1/tensor of the
memory and the bytes stay those of one all-reduce.
"""

import weakref

import keras
import tensorflow as tf

from tfpar._compat import keras_hub_blocks
from tfpar._compat import keras_layers
from tfpar._compat import keras_optimizers
from tfpar._compat import spmd_run
from tfpar._compat.keras_modules import keras_ops
from tfpar._compat.keras_modules import tree
from tfpar.common import instrument
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel.spmd import blocks
from tfpar.tensor_parallel.spmd import slice_graph

AXIS = 1  # [batch, sequence, ...]

_POSITION_WISE = (
    keras.layers.Activation, keras.layers.Add, keras.layers.Subtract,
    keras.layers.Multiply, keras.layers.ReLU, keras_ops.numpy.Add,
    keras_ops.numpy.Subtract, keras_ops.numpy.Multiply,
)


def _is_layer_norm_over_features(operation):
  if not isinstance(operation, keras.layers.LayerNormalization):
    return False
  axes = operation.axis if isinstance(operation.axis, (list, tuple)) else [
      operation.axis]
  return all(a == -1 or a >= 2 for a in axes)


def is_position_wise(operation):
  """Whether `operation` computes each position of the sequence alone (a
  plain `Dropout` too: it draws one device's mask and keeps its slice,
  `dropout.py`; its subclasses get the whole sequence; keras-hub's and
  Keras's RMS norms over the features)."""
  if isinstance(operation, keras.layers.RMSNormalization):
    axes = tf.nest.flatten(operation.axis)
    return all(a == -1 or a >= 2 for a in axes)
  return type(operation) is keras.layers.Dropout or (
      keras_hub_blocks.is_position_wise_norm(operation) or
      _is_layer_norm_over_features(operation) or
      type(operation) in _POSITION_WISE)


def splits(x, tensor_size, layer):
  """Whether sequence parallelism splits activation `x`."""
  if x.shape.rank is None or x.shape.rank < 3 or x.shape[AXIS] is None:
    return False
  if x.shape[AXIS] % tensor_size:
    raise ValueError(
        f"sequence_parallel=True splits activations along the sequence "
        f"(axis {AXIS}), but layer {layer!r} outputs sequence length "
        f"{x.shape[AXIS]}, not divisible by the tensor size {tensor_size}.")
  return True


class Slices:
  """Which activations of the traces are sequence slices, and their
  all-gathers (cleared with the strategy's `Memo` every step trace).

  Args:
    groups: the strategy's `collectives.TensorGroups`.
    float32_sums: gather attention's half-precision input in float32 (its
      gradient's partial sums are then added in float32).
  """

  def __init__(self, groups, float32_sums=False, partial_weights=None):
    self.groups = groups
    self.float32_sums = float32_sums
    self._sliced = {}
    self._walked = {}  # slice_graph's answers for unmarked tensors.
    self._whole = {}
    self.gathered = {}  # Outputs of `for_split_layer` (f already done).
    # Replicated weights applied to slices (LayerNorms, row biases): each
    # device's gradient covers its slice only. Kept across steps, weakly
    # (`Memo.partial_weights`).
    self.partial_weights = weakref.WeakValueDictionary() if (
        partial_weights is None) else partial_weights
    self.scatters = 0  # Reduce-scatters so far (a layer's output sliced?)

  def mark_weights(self, variables):
    """Records replicated `variables` as applied to sequence slices."""
    for variable in variables:
      storage = keras_layers.storage(variable, variable)
      self.partial_weights[id(storage)] = storage

  def clear(self):
    self._sliced.clear()
    self._walked.clear()
    self._whole.clear()
    self.gathered.clear()

  def mark(self, x):
    """Records `x` as a slice; returns it."""
    self._sliced[x.ref()] = x
    return x

  def is_sliced(self, x):
    """Whether `x` is a sequence slice: marked, or computed position by
    position from slices (`slice_graph.py`: inside keras-hub blocks)."""
    return tf.is_tensor(x) and (
        x.ref() in self._sliced or
        slice_graph.is_slice(x, self._sliced, self._walked))

  def gather_arguments(self, args, kwargs, layer, compute_dtype):
    """`(args, kwargs)` of an attention layer with its sequence slices
    all-gathered (in float32 under a half-precision `compute_dtype` with
    float32 sums: its projections' input gradients are summed so)."""
    wide = self.float32_sums and compute_dtype in ("bfloat16", "float16")
    return tree.map_structure(
        lambda x: (self.for_split_layer(
            rounding.widened(x) if wide else x, layer)
                   if self.is_sliced(x) else x), (args, kwargs))

  def for_split_layer(self, x, layer):
    """The whole of slice `x` for a split layer (partial gradients back:
    reduce-scattered), once per slice."""
    key = ("split", x.ref())
    if key not in self._whole:
      whole = collectives.all_gather(self.groups, x, AXIS, layer)
      self._whole[key] = whole
      self.gathered[whole.ref()] = whole
    return self._whole[key]

  def for_replicated(self, x, layer):
    """The whole of slice `x` for replicated work (replicated gradient
    back: each device keeps its slice), once per slice."""
    key = ("replicated", x.ref())
    if key not in self._whole:
      self._whole[key] = collectives.gather(self.groups, x, AXIS, layer)
    return self._whole[key]

  def reduce_scatter(self, y, layer):
    """Sequence parallelism's g on a row-parallel output, if it splits."""
    if splits(y, self.groups.tensor_size, layer):
      self.scatters += 1
      return self.mark(collectives.reduce_scatter(self.groups, y, AXIS,
                                                  layer))
    return None


def install(model, slices):
  """Makes a functional model run its position-wise operations on sequence
  slices and gather slices for everything else.

  Args:
    model: a functional or Sequential model whose layers were split.
    slices: the strategy's `Slices`.

  Raises:
    ValueError: the model has no functional graph (a subclassed model).
  """
  def wrap(operation, call):
    layout = getattr(operation, "_tfpar_layer_layout", None)

    def run(*args, **kwargs):
      if collectives.current_slot() is None:
        return call(*args, **kwargs)
      name = getattr(operation, "name", type(operation).__name__)
      leaves = [x for x in tree.flatten((args, kwargs))
                if slices.is_sliced(x)]
      if layout is not None:
        # A split layer reads slices itself (attention: gathered here);
        # its output is a slice when its row projection reduce-scattered.
        before = slices.scatters
        if layout.kind == layouts.ATTENTION:
          args, kwargs = slices.gather_arguments(args, kwargs, name,
                                                 operation.compute_dtype)
        outputs = call(*args, **kwargs)
        if slices.scatters > before:
          tree.map_structure(
              lambda y: slices.mark(y) if tf.is_tensor(y) else y, outputs)
        return outputs
      if not leaves:
        return call(*args, **kwargs)
      if id(operation) in block_ids:
        return blocks.run(operation, call, args, kwargs, slices)
      if blocks.is_position_embedding(operation):
        return blocks.position_embedding(operation, call, args, kwargs,
                                         slices)
      if is_position_wise(operation):
        def replace(x):
          if (not tf.is_tensor(x) or slices.is_sliced(x) or
              x.shape.rank is None or x.shape.rank < 3):
            return x
          return collectives.scatter(slices.groups, x, AXIS, name)
      else:
        replace = lambda x: (slices.for_replicated(x, name)
                             if slices.is_sliced(x) else x)
      args, kwargs = tree.map_structure(replace, (args, kwargs))
      outputs = call(*args, **kwargs)
      if layout is None and is_position_wise(operation):
        slices.mark_weights(getattr(operation, "trainable_weights", ()))
        tree.map_structure(
            lambda y: slices.mark(y) if tf.is_tensor(y) and
            y.shape.rank is not None and y.shape.rank >= 3 else y, outputs)
      return outputs
    return run

  block_ids = set()
  for block in blocks.containers(model):
    if blocks.is_block(block):
      blocks.install(block, slices)
      block_ids.add(id(block))

  def finish(outputs):
    if collectives.current_slot() is None:
      return outputs
    return tree.map_structure(
        lambda y: slices.for_replicated(y, "outputs")
        if slices.is_sliced(y) else y, outputs)

  if not spmd_run.wrap_graph_run(model, wrap, finish):
    raise ValueError(
        f"TensorParallelStrategy(sequence_parallel=True) needs a "
        f"functional or Sequential model (it runs the model's graph "
        f"operation by operation); {model.name!r} has no graph. Use "
        f"sequence_parallel=False.")


def sum_partial_gradients(optimizer, groups, partial_weights):
  """Makes `optimizer` sum the gradients of replicated weights whose
  gradient on each device is partial over the tensor group first
  (Megatron's all-reduce of LayerNorm gradients under sequence
  parallelism; key/value heads shared by several devices), then over the
  data replicas.

  Args:
    optimizer: the model's Keras optimizer.
    groups: the strategy's `collectives.TensorGroups`.
    partial_weights: {id(storage): storage} of those weights, weakly
      (filled as layers are split; read when the step is traced).
  """
  if getattr(optimizer, "_tfpar_spmd_partial_sums", False):
    return
  original = keras_optimizers.all_reduce_sum_gradients(optimizer)

  def all_reduce(grads_and_vars):
    pairs = []
    for grad, variable in grads_and_vars:
      if (grad is not None and collectives.current_slot() is not None and
          id(variable) in partial_weights):
        grad = collectives.all_reduce(
            groups, tf.convert_to_tensor(grad),
            getattr(variable, "name", "weights"), instrument.BACKWARD)
      pairs.append((grad, variable))
    return original(pairs)

  keras_optimizers.replace_all_reduce_sum_gradients(optimizer, all_reduce)
  object.__setattr__(optimizer, "_tfpar_spmd_partial_sums", True)
