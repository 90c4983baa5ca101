"""Where tensor parallelism rounds under a mixed policy.

With float32 sums (`communication_dtype="float32"`, the default) partial
sums cross devices in float32 and are rounded to the compute dtype once,
as one device's matmul rounds its float32 accumulation; a kernel's
gradient is still taken as one device takes it, on compute-dtype operands
(`widened_product`). `communication_dtype="compute"` is Megatron-LM's
choice: half the bytes, each device rounding its partial sum first.
"""

from keras import ops
import tensorflow as tf


COMMUNICATION_DTYPES = ("float32", "compute")


def float32_sums(communication_dtype):
  """Whether a strategy's `communication_dtype` adds partial sums in
  float32; raises a ValueError for anything but "float32" and "compute"."""
  if communication_dtype not in COMMUNICATION_DTYPES:
    raise ValueError(
        f"communication_dtype must be 'float32' (partial sums added in "
        f"float32 and rounded once, as one device's matmul: training within "
        f"stock Mirrored's spread) or 'compute' (the Keras policy's compute "
        f"dtype, as Megatron-LM communicates: half those bytes under a "
        f"mixed policy). Received: communication_dtype="
        f"{communication_dtype!r}")
  return communication_dtype == "float32"


def widened(x):
  """`x` in float32 where it is (half-precision activations only)."""
  if x.dtype not in (tf.bfloat16, tf.float16):
    return x
  with tf.device(x.device or None):
    return tf.cast(x, tf.float32)


def product(x, kernel, equation):
  if equation is None:
    return ops.matmul(x, kernel)
  return ops.einsum(equation, x, kernel)


def widened_product(x, kernel, equation=None):
  """`x` times the compute-dtype `kernel` (a matmul, or the einsum
  `equation`), taken in float32 and returned in float32.

  Backward, `x`'s gradient is taken in float32 (a partial sum to be added
  over devices, or rounded once by `x`'s cast) and the kernel's as one
  device takes it: the gradient of the same op on compute-dtype operands.
  (Keras computes an einsum such as `bqm,muh->bquh` as a batched matmul, whose
  kernel gradient is a compute-dtype product per batch row, summed; in
  float32 it would be rounded once instead.)"""
  compute_dtype = kernel.dtype

  @tf.custom_gradient
  def widened_op(wide_x, kernel):
    with tf.GradientTape() as tape:
      tape.watch(wide_x)
      y = product(wide_x, tf.cast(kernel, tf.float32), equation)

    def grad(upstream):
      dx = tape.gradient(y, wide_x, output_gradients=upstream)
      narrow_x = tf.cast(wide_x, compute_dtype)  # Exact: compute-dtype values.
      with tf.GradientTape() as narrow:
        narrow.watch(kernel)
        narrow_y = product(narrow_x, kernel, equation)
      dkernel = narrow.gradient(
          narrow_y, kernel,
          output_gradients=tf.cast(upstream, compute_dtype))
      return dx, dkernel
    return y, grad

  return widened_op(ops.cast(x, "float32"), kernel)


def _keras_takes_bias_add(y_shape, bias_shape):
  """Whether Keras's TensorFlow `ops.add(y, bias)` on these shapes is a
  `tf.nn.bias_add` (a bias that squeezes to a vector along `y`'s second or
  last axis) rather than a `tf.add`."""
  squeezed = [d for d in bias_shape if d is None or d > 1]
  return (len(squeezed) == 1 and len(y_shape) > 1 and
          squeezed[0] is not None and
          squeezed[0] in (y_shape[1], y_shape[-1]))


def add_bias(y, bias, whole_bias_shape):
  """`y + bias` (a slice of a bias shaped `whole_bias_shape`, broadcast
  against `y`'s trailing axes) by the op one device's `ops.add` takes on
  the whole layer.

  The two ops' bias gradients round differently: on CPU a bfloat16
  `BiasAddGrad` accumulates in bfloat16 row after row and an `AddV2`'s
  `Sum` in float32, rounded once (in float16, `BiasAddGrad` in float32 and
  `Sum` not). Keras takes `BiasAdd` for a bias that squeezes to a vector,
  as one head's slice of a [heads, head_dim] bias does where the whole
  bias does not (Qwen's query, key and value)."""
  bias = ops.cast(bias, y.dtype)
  whole_y = list(y.shape)
  offset = len(whole_y) - len(bias.shape)
  for axis, (part, whole) in enumerate(zip(bias.shape, whole_bias_shape)):
    if part != whole and whole_y[offset + axis] is not None:
      whole_y[offset + axis] = whole_y[offset + axis] * whole // part
  if _keras_takes_bias_add(whole_y, whole_bias_shape):
    return ops.add(y, bias)
  return tf.add(y, bias)
