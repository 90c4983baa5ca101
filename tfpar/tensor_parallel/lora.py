"""Keras's LoRA factors and quantized kernels, laid out with their base.

A LoRA-enabled `Dense` / `EinsumDense` adds `alpha / r * a @ b` to its
kernel, with `a` of the kernel's leading axes plus `r` and `b` of shape
`[r, last axis]` (a Dense's `a` is `[in, r]`). Each device holds the
factors whose product is the LoRA term of its own shard of the kernel:
the factor holding the kernel's split axis is split along it (`b` for a
split on the last axis, a column-parallel Dense; `a` otherwise: a
row-parallel Dense, keras-hub's attention kernels split by heads), the
other factor is whole on every device. That whole factor's gradient on
each device comes from that device's shard only, so it is summed over the
tensor group (`mark_partial_factor`, read when the step is traced).

A quantized kernel (`model.quantize("int8")`) is split as its float
kernel would be; its per-output-channel `kernel_scale` is split with a
column-parallel kernel and whole with a row-parallel one (its reduced
axes are the split ones). The other modes are refused (`QUANTIZED`).
"""

import keras

from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles

# Quantization modes a split layer may use.
QUANTIZED = ("int8",)


def check_quantization(layer, style, source):
  """Refuses a split layer quantized in a way tfpar cannot split.

  Raises:
    ValueError: `layer.quantization_mode` is not in `QUANTIZED`, or a
      row-parallel int8 layer quantizes its inputs with another quantizer
      than `keras.quantizers.AbsMaxQuantizer` (`spmd/quantized.py`).
  """
  mode = getattr(layer, "quantization_mode", None)
  quantizer = getattr(layer, "inputs_quantizer", None)
  if mode == "int8" and isinstance(style, styles.RowParallel) and (
      quantizer is not None and
      type(quantizer) is not keras.quantizers.AbsMaxQuantizer):
    raise ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) quantizes its "
        f"inputs with {type(quantizer).__name__} ({source} gives it "
        f"{style}): split on its input features, tensor parallelism takes "
        f"the whole input's range for keras.quantizers.AbsMaxQuantizer "
        f"only. Use that quantizer (the default), or give the layer's "
        f"weights tfpar.Replicate().")
  if mode is None or mode in QUANTIZED:
    return
  raise ValueError(
      f"Layer {layer.name!r} ({type(layer).__name__}) is quantized with "
      f"quantization_mode={mode!r} ({source} gives it {style}); tensor "
      f"parallelism splits quantized kernels of mode "
      f"{', '.join(map(repr, QUANTIZED))} only ({_WHY.get(mode, '')}). "
      f"Quantize with model.quantize('int8'), or give the layer's weights "
      f"tfpar.Replicate(), e.g. ShardingPlan([({layer.name + '/.*'!r}, "
      f"tfpar.Replicate())]).")


_WHY = {
    "float8": "its scales and amax histories are per whole tensor",
    "int4": "its kernel packs two columns per byte",
    "gptq": "its kernel is packed and its groups cross the split",
    "awq": "its kernel is packed and its groups cross the split",
}


def extra_layouts(layer, kernel, kernel_axis, style, source):
  """The `VariableLayout`s of a split projection's LoRA factors and int8
  kernel scale (empty when it has none).

  Args:
    layer: a Dense or EinsumDense split on kernel axis `kernel_axis`.
    kernel: its kernel variable.
    kernel_axis: the axis of its kernel that is split.
    style: its style (COLUMN or ROW).
    source: what decided it, for `describe`.
  """
  found = lora_layouts(layer, kernel_axis, style, source)
  if getattr(layer, "quantization_mode", None) == "int8":
    axis = None
    if isinstance(style, styles.ColumnParallel):
      axis = scale_axis(layer, kernel.shape[kernel_axis], kernel_axis)
    found.append(_layout(layer.kernel_scale, style if axis is not None else
                         styles.REPLICATE, axis, source))
  return found


def lora_layouts(layer, kernel_axis, style, source):
  """The `VariableLayout`s of the LoRA factors of a projection split on
  kernel axis `kernel_axis` (none without LoRA)."""
  if not getattr(layer, "lora_enabled", False):
    return []
  a, b = layer.lora_kernel_a, layer.lora_kernel_b
  last = len(a.shape) - 1  # The kernel's rank less one.
  split, whole, axis = (b, a, 1) if kernel_axis == last else (
      a, b, kernel_axis)
  return [_layout(split, style, axis, source),
          _layout(whole, styles.REPLICATE, None,
                  f"{source}; LoRA factor, gradient summed over the tensor "
                  f"group")]


def scale_axis(layer, size, kernel_axis):
  """The axis of an int8 layer's `kernel_scale` holding the `size` output
  channels of kernel axis `kernel_axis` (an output axis).

  A Dense's scale is `[units]`; an EinsumDense's is laid out along its
  output (Keras's `_adjust_scale_for_quant`), the size-1 axes of the
  reduced ones kept where output axes are missing from the kernel.
  """
  shape = tuple(layer.kernel_scale.shape)
  if not hasattr(layer, "equation"):
    return 0
  _, kernel_letters, output = layouts.einsum_letters(layer.equation)
  letter = kernel_letters[kernel_axis]
  axis = len(shape) - (len(output) - output.index(letter))
  if not 0 <= axis < len(shape) or shape[axis] != size:
    raise ValueError(
        f"Layer {layer.name!r} (equation {layer.equation!r}): its int8 "
        f"kernel_scale of shape {shape} has no axis of the output channels "
        f"of kernel axis {kernel_axis} ({size}), which tensor parallelism "
        f"would split with the kernel. Give the layer's weights "
        f"tfpar.Replicate().")
  return axis


def _layout(variable, style, axis, source):
  return layouts.VariableLayout(variable.path, tuple(variable.shape), style,
                                axis, source)


def mark_partial_factor(layer, memo):
  """Marks the whole LoRA factor of a split `layer` as having a partial
  gradient on each device (as the step is traced, so the mark names the
  storage the step uses)."""
  if not getattr(layer, "lora_enabled", False):
    return
  memo.mark_partial([v for v in (layer.lora_kernel_a, layer.lora_kernel_b)
                     if getattr(v, "_tfpar_shard_of", None) is None])
