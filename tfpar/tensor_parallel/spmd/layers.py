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
* vocabulary-parallel Embedding: each device looks up the rows it holds
  (zeros elsewhere), `g` sums them.

`f` is applied once per replicated tensor and trace, however many split
projections read it (query, key and value; a gated MLP's gate and up), so
its backward all-reduce sums their input gradients once.

Under a half-precision policy with `communication_dtype="float32"` (the
default) partial sums cross in float32 and are rounded once, as one
device's matmul rounds its float32 accumulation: row-parallel products
are taken in float32 (`rounding.widened_product`), and `f` hands the
column-parallel projections a float32 copy of their input, whose gradient
is summed in float32. With `"compute"` they cross in the compute dtype.
"""

from keras import ops

from tfpar.tensor_parallel import builtin
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel import structure
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel.spmd import collectives
from tfpar.tensor_parallel.spmd import sequence


class Memo:
  """`f` of each replicated tensor, once per trace, and with sequence
  parallelism the sequence slices (cleared per step trace by the
  strategy).

  Args:
    groups: the strategy's `collectives.TensorGroups`.
    sequence_parallel: whether row-parallel outputs are reduce-scattered
      along the sequence.
    float32_sums: under a half-precision policy, add partial sums in
      float32 (`communication_dtype="float32"`).
  """

  def __init__(self, groups, sequence_parallel=False, float32_sums=False):
    self.groups = groups
    self.outputs = {}
    self.slices = sequence.Slices(groups, float32_sums) if (
        sequence_parallel) else None
    self.float32_sums = float32_sums

  def wide(self, layer):
    """Whether `layer` adds its partial sums in float32 (a half-precision
    compute dtype and the strategy's `communication_dtype="float32"`)."""
    return self.float32_sums and layer.compute_dtype in ("bfloat16",
                                                        "float16")

  def f_wide(self, x, layer):
    """`f` of a float32 copy of half-precision `x` (once per tensor), so
    the input gradients of the split projections are summed in float32
    and rounded once, by the copy's cast."""
    key = ("wide", x.ref())
    if key not in self.outputs:
      wide = rounding.widened(x)
      if self.slices is not None and self.slices.is_sliced(x):
        out = self.slices.for_split_layer(wide, layer)
      elif self.slices is not None and x.ref() in self.slices.gathered:
        out = wide  # Gathered for attention: its gradient is scattered.
      elif self.slices is not None and _cast_of(x, self.slices.gathered):
        out = x.op.inputs[0]  # Keras's cast of a float32 gather: the gather.
      else:
        out = collectives.f(self.groups, wide, layer)
      self.outputs[key] = (x, out)
    return self.outputs[key][1]

  def f(self, x, layer):
    """`x` for split projections: `collectives.f(x)`, made once per
    tensor; a sequence slice all-gathered instead."""
    if self.slices is not None and self.slices.is_sliced(x):
      return self.slices.for_split_layer(x, layer)
    if self.slices is not None and x.ref() in self.slices.gathered:
      return x
    key = x.ref() if hasattr(x, "ref") else id(x)
    if key not in self.outputs:
      self.outputs[key] = (x, collectives.f(self.groups, x, layer))
    return self.outputs[key][1]

  def g(self, y, layer):
    """The sum of partial results `y`: reduce-scattered along the
    sequence with sequence parallelism, else all-reduced."""
    if self.slices is not None and collectives.current_slot() is not None:
      scattered = self.slices.reduce_scatter(y, layer)
      if scattered is not None:
        return scattered
    return collectives.g(self.groups, y, layer)

  def whole(self, x, layer):
    """`x`, a sequence slice gathered for replicated work."""
    if self.slices is not None and self.slices.is_sliced(x):
      return self.slices.for_replicated(x, layer)
    return x

  def clear(self):
    self.outputs.clear()
    if self.slices is not None:
      self.slices.clear()


def _cast_of(x, gathered):
  """Whether `x` is a cast of a tensor in `gathered` (Keras casting the
  float32 sequence gather of attention's input to the compute dtype)."""
  op = getattr(x, "op", None)
  return (op is not None and op.type == "Cast" and
          op.inputs[0].ref() in gathered)


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
  stock = layer.call
  axis = layouts.activation_split_axis(layer, styles.COLUMN)

  def call(inputs, *args, **kwargs):
    if memo.wide(layer):
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
    if not paired:  # A replicated input: this device's features of it.
      inputs = collectives.scatter(memo.groups, memo.whole(inputs, layer.name),
                                   axis, layer.name)
    if memo.wide(layer):  # Partial sums in float32, rounded once.
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


def _vocab(layer, memo):
  tensor_size = memo.groups.tensor_size
  rows = layer.input_dim // tensor_size

  def call(inputs, *args, **kwargs):
    del args, kwargs
    slot = collectives.current_slot()
    index = 0 if slot is None else slot.tensor_index
    if inputs.dtype not in ("int32", "int64"):
      inputs = ops.cast(inputs, "int32")
    local = inputs - index * rows
    inside = ops.logical_and(local >= 0, local < rows)
    looked_up = ops.take(layer.embeddings, ops.where(inside, local, 0),
                         axis=0)
    # Partial rows cross in the compute dtype: exact, one is not zero.
    looked_up = ops.cast(looked_up, layer.compute_dtype)
    looked_up = looked_up * ops.cast(inside, looked_up.dtype)[..., None]
    return memo.g(looked_up, layer.name)
  return call


def _set_call(layer, call):
  object.__setattr__(layer, "call", call)


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
  if kind == layouts.ATTENTION:
    for role, dense in builtin.attention_parts(layer).items():
      _set_call(dense, _row(dense, memo) if role == "output"
                else _column(dense, memo))
  elif kind == layouts.EMBEDDING:
    _set_call(layer, _vocab(layer, memo))
  elif isinstance(layer_layout.style, styles.RowParallel):
    _set_call(layer, _row(layer, memo, layer in paired))
  else:
    _set_call(layer, _column(layer, memo, layer in paired))
