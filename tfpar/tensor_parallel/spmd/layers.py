"""SPMD forward passes for the stock Keras layers the plans split.

Every trace reads its local shard through the layer's own attributes
(`split_layer` put an SPMD variable there), so most layers keep their
stock `call`:

* column-parallel Dense / EinsumDense (and the query / key / value
  projections of MultiHeadAttention): Megatron's `f` on the input, then
  the stock call on the local shard (output features / heads split);
* row-parallel Dense / EinsumDense (MultiHeadAttention's output): the
  local partial product, `g` (all-reduce), then the whole bias and the
  activation;
* a column-parallel layer whose output does not go (through elementwise
  ops) to a row-parallel one all-gathers it; a row-parallel layer no
  column-parallel one feeds takes its slice of its replicated input;
* vocabulary-parallel Embedding (and keras-hub's ReversibleEmbedding):
  `embeddings.py`.

`f` is applied once per replicated tensor and trace (`memo.py`), however
many split projections read it (query, key and value; a gated MLP's gate
and up), so its backward all-reduce sums their input gradients once.

Under a half-precision policy with `communication_dtype="float32"` (the
default) partial sums cross in float32 and are rounded once, as one
device's matmul rounds its float32 accumulation: row-parallel products
are taken in float32 (`rounding.widened_product`), and `f` hands the
column-parallel projections a float32 copy of their input, whose gradient
is summed in float32. With `"compute"` they cross in the compute dtype.
"""

import keras
from keras import ops

from tfpar._compat import keras_layers
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import builtin
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import lora
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel import shared_heads
from tfpar.tensor_parallel import structure
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel.spmd import embeddings
from tfpar.tensor_parallel.spmd import head_terms
from tfpar.tensor_parallel.spmd import quantized as quantized_lib
from tfpar.tensor_parallel.spmd import terms


def _whole_shape(variable):
  """The whole weight's shape of a local SPMD shard (or the variable's)."""
  shard_of = getattr(variable, "_tfpar_shard_of", None)
  return tuple(shard_of[0].shape if shard_of else variable.shape)


def _wide_column(layer, memo, inputs):
  """The column projection of a half-precision layer with float32 sums:
  the compute-dtype product taken in float32 and rounded once."""
  equation = getattr(layer, "equation", None)
  y = rounding.widened_product(memo.f_wide(inputs, layer.name),
                               ops.cast(layer.kernel, layer.compute_dtype),
                               equation)
  y = ops.cast(y, layer.compute_dtype)
  if layer.bias is not None:
    y = rounding.add_bias(y, layer.bias, _whole_shape(layer.bias))
  if layer.activation is not None:
    y = layer.activation(y)
  return y


def _column(layer, memo, paired=True):
  quantized = quantized_lib.is_quantized(layer)
  # An int8 layer's own quantized call, on its shard (`quantized.py`).
  stock = layer.quantized_call if quantized else layer.call
  axis = layouts.activation_split_axis(layer, styles.COLUMN)

  def call(inputs, *args, **kwargs):
    lora.mark_partial_factor(layer, memo)
    if memo.wide(layer) and not quantized:
      y = _wide_column(layer, memo, inputs)
    else:
      y = stock(memo.f(inputs, layer.name), *args, **kwargs)
    if not paired:  # Replicated layers read it: whole on every device.
      y = collectives.gather(memo.groups, y, axis, layer.name)
    return y
  return call


def _row(layer, memo, paired=True):
  equation = getattr(layer, "equation", None)
  axis = layouts.activation_split_axis(layer, styles.ROW)

  def call(inputs, training=None):
    del training
    lora.mark_partial_factor(layer, memo)
    if not paired:  # A replicated input: this device's features of it.
      inputs = collectives.scatter(memo.groups, memo.whole(inputs, layer.name),
                                   axis, layer.name)
    if quantized_lib.is_quantized(layer):
      y = quantized_lib.row_partial(layer, memo, inputs)
    elif memo.wide(layer):  # Partial sums in float32, rounded once.
      y = rounding.widened_product(
          inputs, ops.cast(layer.kernel, layer.compute_dtype), equation)
    elif equation is None:
      y = ops.matmul(inputs, layer.kernel)
    else:
      y = ops.einsum(equation, inputs, layer.kernel)
    y = memo.g(y, layer.name)
    if layer.bias is not None and memo.slices is not None and (
        memo.slices.is_sliced(y)):
      memo.slices.mark_weights([layer.bias])
    y = ops.cast(y, layer.compute_dtype)
    if layer.bias is not None:
      y = ops.add(y, layer.bias)
    if layer.activation is not None:
      y = layer.activation(y)
    return y
  # Its input holds this device's features only.
  layer.input_spec = None
  return call


def _shared_head(dense, memo, sharers, rotated=None):
  """A key or value projection kept whole because its heads are fewer than
  the devices: each device computes the head its query heads use; the
  first device computing a head takes its kernel gradient from all their
  query heads' gradients (`summed_by_first_sharer`), and the strategy
  sums the kernel gradients, each head's columns from one device, over
  the tensor group (`mark_partial`). A key that the layer's rotary
  embedding rotates is summed after the rotation, as one device repeats
  the rotated key (`rotated` records it for `_sum_rotated_key`)."""
  def call(inputs, training=None):
    del training
    # Marked as traced, so the mark names the variables the step uses
    # (ZeRO-3 gives the kernel sliced storage after the model is sharded).
    memo.mark_partial(dense.weights)
    slot = collectives.current_slot()
    index = 0 if slot is None else slot.tensor_index
    wide = memo.wide(dense)
    if quantized_lib.is_quantized(dense):  # Its activation included.
      y = quantized_lib.shared_head(dense, memo.f(inputs, dense.name),
                                    index // sharers)
    else:
      x = (memo.f_wide(inputs, dense.name) if wide else
           memo.f(inputs, dense.name))
      y = shared_heads.head_slice(dense, x, index // sharers, wide)
      if dense.activation is not None:
        y = dense.activation(y)
    if rotated is not None:
      rotated["key"] = y
      return y
    return collectives.summed_by_first_sharer(memo.groups, y, sharers,
                                              dense.name)
  return call


def _sum_rotated_key(rotary, memo, sharers, rotated, name):
  """Wraps the rotary embedding layer's call: the key it rotates (the one
  `_shared_head` recorded in `rotated`) comes out `summed_by_first_sharer`."""
  original = rotary.call

  def call(inputs, *args, **kwargs):
    y = original(inputs, *args, **kwargs)
    if rotated.get("key") is inputs:
      del rotated["key"]
      y = collectives.summed_by_first_sharer(memo.groups, y, sharers, name)
    return y
  _set_call(rotary, call)


def _install_heads(layer_layout, memo):
  """A keras-hub attention layer split by heads (`families.py`): its own
  call on every device with the head counts set to the device's share; the
  query / key / value projections column-parallel (or, with fewer
  key/value heads than devices, `_shared_head`), the output row-parallel.
  Replica threads trace one at a time, so the counts are set for the
  call's duration."""
  layer = layer_layout.layer
  family = families.family_of(layer)
  t = memo.groups.tensor_size
  per_device = families.key_value_heads_per_device(layer, family, t)
  _, key_value = family.head_counts(layer)
  sharers = t // key_value if key_value < t else 1
  local = family.local_attributes(layer, t, per_device)
  rotary = shared_heads.rotary_of(layer) if sharers > 1 else None
  rotated = {} if rotary is not None else None
  if rotary is not None:
    _sum_rotated_key(rotary, memo, sharers, rotated, layer.name)
  for role, dense in family.projections(layer).items():
    if role == "output":
      _set_call(dense, _row(dense, memo))
    elif role in ("key", "value") and sharers > 1:
      _set_call(dense, _shared_head(dense, memo, sharers,
                                    rotated if role == "key" else None))
    else:
      _set_call(dense, _column(dense, memo))
  original = type(layer).call.__get__(layer)
  query, _ = family.head_counts(layer)
  found = getattr(family, "found", None)  # A `TracedFamily`'s.
  arguments = found.head_arguments if found is not None else ()
  for sub in keras_layers.flatten_layers(layer, include_self=False):
    if type(sub).__name__ in families.HEAD_BIAS_LAYERS:
      _set_call(sub, head_terms.head_bias(sub, memo, query))

  head_local = family.head_local_weights(layer)

  def call(*args, **kwargs):
    memo.mark_partial(head_local)  # Each device's heads' gradient.
    if arguments:
      args, kwargs = head_terms.device_heads_of_arguments(args, kwargs,
                                                          arguments, t)
    if memo.slices is not None and collectives.current_slot() is not None:
      # In a block run on sequence slices: the whole sequence (rotary
      # positions, scores), gathered once for all its projections.
      args, kwargs = memo.slices.gather_arguments(args, kwargs, layer.name,
                                                  layer.compute_dtype)
    saved = {name: getattr(layer, name) for name in local}
    try:
      for name, value in local.items():
        object.__setattr__(layer, name, value)
      result = original(*args, **kwargs)
    finally:
      for name, value in saved.items():
        object.__setattr__(layer, name, value)
    if rotated:
      raise ValueError(
          f"Layer {layer.name!r} ({type(layer).__name__}) did not rotate its "
          f"key projection's output with its rotary embedding layer, which "
          f"Tensor parallelism relies on to sum a key head "
          f"shared by {sharers} devices as one device does.")
    # With a `cache` (generate, `spmd/generation.py`): (output, the
    # device's heads' cache).
    # (GPT-NeoX returns (output, None) without one; SmolLM3 names it
    # `self_attention_cache`.)
    cached = any(name.endswith("cache") and value is not None
                 for name, value in kwargs.items())
    if isinstance(result, (tuple, list)) and not (len(result) == 2 and (
        cached or result[1] is None)):
      raise ValueError(
          f"Layer {layer.name!r} ({type(layer).__name__}) returned "
          f"{len(result)} values (attention scores?); tensor parallelism "
          f"computes the attention output, and with a `cache` argument "
          f"(generate) the output and the device's heads' cache, only.")
    return result
  _set_call(layer, call)


def _set_call(layer, call):
  object.__setattr__(layer, "call", call)
  # Keras calls a quantized layer's `quantized_call` instead.
  object.__setattr__(layer, "quantized_call", call)


def paired_layers(model, layer_layouts):
  """The split Dense / EinsumDense layers of `model` in column -> row
  pairs (a column-parallel output reaching a row-parallel layer through
  elementwise ops only: Megatron's MLP), which exchange split activations;
  the others gather their output (column) or slice their input (row)."""
  wanted = {layout.layer: type(layout.style) for layout in layer_layouts
            if layout.kind in (layouts.DENSE, layouts.EINSUM)}
  candidates = list(wanted)
  while True:  # Drop layers whose plan style the pairing contradicts.
    found = structure.mlp_styles(model, candidates)
    wrong = {layer for layer, style in found.items()
             if wanted[layer] is not type(style)}
    if not wrong:
      return set(found)
    candidates = [layer for layer in candidates if layer not in wrong]


def install(layer_layout, memo, paired=()):
  """Makes a layer split by `split_layer` compute SPMD.

  Args:
    layer_layout: its `LayerLayout` (kind DENSE, EINSUM, ATTENTION or
      EMBEDDING; `checks.check_layouts` refused the others).
    memo: the strategy's `Memo` (its tensor groups and `f` cache).
    paired: the layers `paired_layers` found.
  """
  layer = layer_layout.layer
  kind = layer_layout.kind
  if kind == layouts.HEADS:
    _install_heads(layer_layout, memo)
  elif kind == layouts.EMBEDDING and isinstance(
      layer, keras.layers.ReversibleEmbedding):
    _set_call(layer, embeddings.reversible(layer, memo))
  elif kind == layouts.ATTENTION:
    for role, dense in builtin.attention_parts(layer).items():
      _set_call(dense, _row(dense, memo) if role == "output"
                else _column(dense, memo))
  elif kind == layouts.EMBEDDING:
    _set_call(layer, embeddings.vocab(layer, memo))
  elif isinstance(layer_layout.style, styles.RowParallel):
    _set_call(layer, _row(layer, memo, layer in paired))
  else:
    _set_call(layer, _column(layer, memo, layer in paired))
  terms.sum_activity_terms(layer, memo, layer in paired and isinstance(
      layer_layout.style, styles.ColumnParallel))
