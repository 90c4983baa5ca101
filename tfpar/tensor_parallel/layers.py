"""Tensor-parallel forward passes for stock Keras layers.

`install` replaces a sharded layer's `call` (on that instance only): every
shard computes on its own device (`compute.on_device`) and the layer
communicates through `comm`. A column-parallel output is returned gathered
onto the head, tagged with its shards (`tags`); a row-parallel layer that
receives such a tensor uses the shards directly, so TensorFlow prunes the
unused gather from the traced step (Megatron's f/g pairs).

Under a mixed policy, with `float32_sums` (the strategies' default,
`communication_dtype="float32"`) the partial products of row-parallel
layers and the input gradients of column-parallel ones cross devices in
float32 and are rounded to the compute dtype once after the sum, as one
device's matmul rounds its float32 accumulation. Without it
(`communication_dtype="compute"`, Megatron's choice) they cross in the
compute dtype, half the bytes, and each device rounds its partial sums
before they are added.
"""

from keras import ops
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.tensor_parallel import comm
from tfpar.tensor_parallel import compute
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import regions
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel import tags
from tfpar.tensor_parallel import variables as variables_lib

def spread(x, devices, name, float32=False):
  """`x` whole on every device: all-gathered from its sequence slices if it
  has them, else broadcast from the head; with `float32`, a half-precision
  `x` crosses in float32, so that the gradients coming back are summed in
  float32 (the projections that take it must then compute in float32)."""
  chunks = tags.sequence_chunks(x, devices)
  if chunks is not None:
    if float32:
      chunks = [rounding.widened(c) for c in chunks]
    return comm.all_gather(chunks, tags.SEQUENCE_AXIS, devices, name)
  return comm.broadcast(rounding.widened(x) if float32 else x, devices, name)


def _splits_sequence(tensor, devices, name):
  """Whether sequence parallelism applies to this [batch, sequence, ...]
  activation."""
  if tensor.shape.rank is None or tensor.shape.rank < 3:
    return False
  length = tensor.shape[tags.SEQUENCE_AXIS]
  if length is not None and length % len(devices):
    raise ValueError(
        f"sequence_parallel=True splits activations along the sequence "
        f"(axis {tags.SEQUENCE_AXIS}), but layer {name!r} outputs sequence "
        f"length {length}, not divisible by the tensor size {len(devices)}.")
  return length is not None


def combine(partials, devices, name, finish, sequence_parallel):
  """The sum of the shards' partial results, then `finish` (unsplit bias,
  activation): on the head, or with sequence parallelism reduce-scattered
  and finished slice by slice on every device."""
  if sequence_parallel and _splits_sequence(partials[0], devices, name):
    chunks = comm.reduce_scatter(partials, tags.SEQUENCE_AXIS, devices, name)
    chunks = [compute.on_device(device, finish, chunk)
              for device, chunk in zip(devices, chunks)]
    whole = comm.gather(chunks, tags.SEQUENCE_AXIS, devices, name)
    return tags.tag_sequence(whole, chunks, devices)
  total = comm.reduce(partials, devices, name)
  with tf.device(devices[0]):
    return finish(total)


def _shard(weight, index):
  if isinstance(weight, variables_lib.ShardedWeight):
    return weight.shards[index]
  return weight


def project(layer, x, index, equation=None, partial=False, float32=False):
  """Shard `index` of a Dense (equation None) or EinsumDense projection,
  before any bias that is not split.

  With `float32` under a half-precision compute dtype, the product of the
  compute-dtype operands is taken in float32 and, for a `partial` product
  (row-parallel: to be summed over devices), returned in float32;
  otherwise rounded to the compute dtype once, as one device's matmul is.
  """
  kernel = _shard(keras_layers.dense_kernel(layer), index)
  widen = float32 and layer.compute_dtype in ("bfloat16", "float16")
  if widen:
    y = rounding.widened_product(
        x, ops.cast(kernel, layer.compute_dtype), equation)
  else:
    y = rounding.product(x, kernel, equation)
  if widen and partial:
    return y
  if widen:
    y = ops.cast(y, layer.compute_dtype)
  if isinstance(layer.bias, variables_lib.ShardedWeight):
    y = rounding.add_bias(y, layer.bias.shards[index], layer.bias.shape)
  return y


def finisher(layer):
  """Adds the layer's unsplit bias, then applies its activation."""
  def finish(y):
    y = ops.cast(y, layer.compute_dtype)  # Float32 partial sums, once.
    if layer.bias is not None and not isinstance(
        layer.bias, variables_lib.ShardedWeight):
      y = ops.add(y, layer.bias)
    if layer.activation is not None:
      y = layer.activation(y)
    return y
  return finish


def _column(layout, group, sequence_parallel, float32_sums):
  del sequence_parallel  # Its input arrives whole or is all-gathered.
  layer = layout.layer
  equation = getattr(layer, "equation", None)
  axis = layouts.activation_split_axis(layer, styles.COLUMN)
  elementwise = regions.is_elementwise(layer.activation) and not (
      layer.bias is not None and
      not isinstance(layer.bias, variables_lib.ShardedWeight))

  def call(inputs, training=None):
    del training
    devices = group()
    xs = spread(inputs, devices, layer.name, float32_sums)
    outs = []
    for index, device in enumerate(devices):
      def shard_fn(x, index=index):
        y = project(layer, x, index, equation, float32=float32_sums)
        if elementwise and layer.activation is not None:
          y = layer.activation(y)
        return y
      outs.append(compute.on_device(device, shard_fn, xs[index]))
    whole = comm.gather(outs, axis, devices, layer.name)
    if elementwise:
      return tags.tag_split(whole, outs, axis, devices)
    with tf.device(devices[0]):
      return finisher(layer)(whole)
  return call


def _region_parts(inputs, axis, devices):
  """Per-device slices of `inputs` recomputed from split column outputs
  through the elementwise ops between them (a gated MLP's
  `silu(gate) * up`), or None when `inputs` is not such a region."""
  region = regions.find(
      inputs, lambda t: tags.split_parts(t, axis, devices), axis)
  if region is None:
    return None
  keys = list(region.sources)

  def shard_fn(*pieces):
    return region.emit(dict(zip(keys, pieces[:len(keys)])),
                       pieces[len(keys):])
  return [compute.on_device(
      device, shard_fn,
      *[region.sources[key][index] for key in keys], *region.side)
          for index, device in enumerate(devices)]


def _row(layout, group, sequence_parallel, float32_sums):
  layer = layout.layer
  equation = getattr(layer, "equation", None)
  axis = layouts.activation_split_axis(layer, styles.ROW)

  def call(inputs, training=None):
    del training
    devices = group()
    xs = tags.split_parts(inputs, axis, devices)
    if xs is None:
      # Not when ZeRO-3 wrapped this call to run it again in the backward
      # pass: the region's split tensors lie outside what it runs again,
      # so their gradients would be lost.
      xs = (_region_parts(inputs, axis, devices)
            if vars(layer).get("call") is call else None)
    if xs is None:
      xs = comm.scatter(inputs, axis, devices, layer.name)
    partial = [
        compute.on_device(device, lambda x, i=index: project(
            layer, x, i, equation, partial=True, float32=float32_sums),
                          xs[index])
        for index, device in enumerate(devices)]
    return combine(partial, devices, layer.name, finisher(layer),
                    sequence_parallel)
  return call


def _vocab(layout, group, sequence_parallel, float32_sums):
  # Its partial rows are exact (one of them is not zero); `float32_sums`
  # matters for its reversed use (tied logits).
  layer = layout.layer
  rows = layer.input_dim // len(keras_layers.embeddings(layer).shards)

  reverse_call = _reverse(layer, group, float32_sums)

  def call(inputs, reverse=False):
    if reverse:
      return reverse_call(inputs)
    devices = group()
    if inputs.dtype not in (tf.int32, tf.int64):
      inputs = ops.cast(inputs, "int32")
    ids = comm.broadcast(inputs, devices, layer.name)
    parts = []
    for index, device in enumerate(devices):
      def shard_fn(token_ids, index=index):
        local = token_ids - index * rows
        inside = ops.logical_and(local >= 0, local < rows)
        looked_up = ops.take(keras_layers.embeddings(layer).shards[index],
                             ops.where(inside, local, 0), axis=0)
        # Partial rows cross devices in the compute dtype (exact: only one
        # device's row is not zero).
        looked_up = ops.cast(looked_up, layer.compute_dtype)
        return looked_up * ops.cast(inside, looked_up.dtype)[..., None]
      parts.append(compute.on_device(device, shard_fn, ids[index]))
    return combine(parts, devices, layer.name,
                    lambda y: ops.cast(y, layer.compute_dtype),
                    sequence_parallel)
  return call


def _reverse(layer, group, float32_sums):
  """`keras.layers.ReversibleEmbedding(...)(x, reverse=True)` on a table
  split on the vocabulary: each device computes its slice of the logits
  (with `float32_sums`, from a float32 copy of its input, so that the
  input's gradient is summed in float32)."""
  tied = getattr(layer, "tie_weights", True)

  def call(inputs):
    devices = group()
    xs = spread(inputs, devices, layer.name, float32_sums)
    outs = []
    for index, device in enumerate(devices):
      def shard_fn(x, index=index):
        if tied:
          kernel = ops.transpose(keras_layers.embeddings(layer).shards[index])
        else:
          kernel = layer.reverse_embeddings.shards[index]
        if layer.reverse_dtype is not None:
          x = ops.cast(x, layer.reverse_dtype)
          kernel = ops.cast(kernel, layer.reverse_dtype)
          logits = ops.matmul(x, kernel)
        elif x.dtype != kernel.dtype:  # A float32 copy (`float32_sums`).
          logits = ops.cast(ops.matmul(x, ops.cast(kernel, x.dtype)),
                            kernel.dtype)
        else:
          logits = ops.matmul(x, kernel)
        if layer.logit_soft_cap is not None:
          cap = layer.logit_soft_cap
          logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits
      outs.append(compute.on_device(device, shard_fn, xs[index]))
    whole = comm.gather(outs, -1, devices, layer.name)
    return tags.tag_split(whole, outs, -1, devices)
  return call


_BUILDERS = {
    (layouts.DENSE, styles.ColumnParallel): _column,
    (layouts.DENSE, styles.RowParallel): _row,
    (layouts.EINSUM, styles.ColumnParallel): _column,
    (layouts.EINSUM, styles.RowParallel): _row,
    (layouts.EMBEDDING, styles.VocabParallel): _vocab,
}


def install(layer_layout, group, sequence_parallel=False,
            float32_sums=False):
  """Makes a sharded layer compute tensor-parallel.

  Args:
    layer_layout: its `LayerLayout` (variables already sharded).
    group: a function returning the current replica's devices.
    sequence_parallel: leave [batch, sequence, ...] outputs of row-parallel
      layers split along the sequence (reduce-scatter instead of reduce).
    float32_sums: under a half-precision policy, add partial sums in
      float32 (see the module's docstring).
  """
  if layer_layout.kind in (layouts.ATTENTION, layouts.HEADS):
    from tfpar.tensor_parallel import heads  # pylint: disable=g-import-not-at-top
    from tfpar.tensor_parallel import stock_attention  # pylint: disable=g-import-not-at-top
    builder = (stock_attention.multi_head_attention
               if layer_layout.kind == layouts.ATTENTION else heads.replay)
  else:
    builder = _BUILDERS[(layer_layout.kind, type(layer_layout.style))]
  object.__setattr__(layer_layout.layer, "call",
                     builder(layer_layout, group, sequence_parallel,
                             float32_sums))
