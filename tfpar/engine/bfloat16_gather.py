"""Gathers of bfloat16 values: `strategy.gather`, and the rows of sparse
gradients (an `Embedding`'s under the pure `"bfloat16"` policy).

TensorFlow's CPU collectives take no bfloat16 ("DataType bfloat16 not in
list of allowed values"), and Keras gathers `predict`'s outputs across
workers with `strategy.gather`: under `mixed_bfloat16` a model whose last
layer computes in bfloat16 could not predict across workers. The bits of a
bfloat16 tensor move as float16 (same width, nothing is converted) and are
read back as bfloat16. Stock `MirroredStrategy` fails on both.
"""

import tensorflow as tf

from tfpar._compat.tf_modules import values_lib


class Bfloat16Gather:
  """Mixin of `MeshExtended`: `strategy.gather` of bfloat16 values."""

  def _gather_to_implementation(self, value, destinations, axis, options):
    distributed = isinstance(value, values_lib.DistributedValues)
    first = value.values[0] if distributed else value
    if getattr(first, "dtype", None) != tf.bfloat16:
      return super()._gather_to_implementation(value, destinations, axis,
                                               options)
    if distributed:
      as_half = []
      for component in value.values:
        with tf.device(component.device):
          as_half.append(tf.bitcast(component, tf.float16))
      as_half = values_lib.PerReplica(tuple(as_half))
    else:  # One replica on this worker.
      with tf.device(value.device):
        as_half = tf.bitcast(value, tf.float16)
    gathered = super()._gather_to_implementation(as_half, destinations, axis,
                                                 options)
    return tf.bitcast(gathered, tf.bfloat16)


def sparse_bfloat16(value):
  """Whether `value` (per replica) is a bfloat16 sparse gradient, whose
  rows the CPU collectives cannot all-gather."""
  return any(isinstance(part, tf.IndexedSlices) and
             part.dtype == tf.bfloat16 for part in _parts(value))


def _parts(value):
  """The per-device components of `value` (itself if not distributed; an
  `IndexedSlices` has `values` of its own)."""
  if isinstance(value, values_lib.DistributedValues):
    return value.values
  return (value,)


def _retyped(part, dtype):
  """An `IndexedSlices` whose values' bits are read as `dtype`."""
  if not isinstance(part, tf.IndexedSlices):
    return part
  with tf.device(part.values.device or None):
    return tf.IndexedSlices(tf.bitcast(part.values, dtype), part.indices,
                            part.dense_shape)


def reduce_sparse_as_float16(reduce, reduce_op, pairs):
  """`reduce(op, pairs)` with bfloat16 sparse gradients moved as float16
  bit patterns (the all-gather of their rows only copies bits) and read
  back as bfloat16.

  Args:
    reduce: `(reduce_op, pairs) -> reduced values`, the strategy's
      batch reduction.
    reduce_op: a `tf.distribute.ReduceOp`; SUM (what Keras's optimizers
      reduce gradients with).
    pairs: (per-replica value, destination) pairs.

  Returns:
    The reduced values, in `pairs` order.

  Raises:
    ValueError: for a MEAN, which would divide the bit patterns as float16
      numbers.
  """
  if reduce_op != tf.distribute.ReduceOp.SUM:
    raise ValueError(
        f"reduce_op = {reduce_op} of bfloat16 sparse values: tfpar moves "
        f"their rows through CPU collectives as float16 bit patterns, which "
        f"only a SUM (a gather of rows) leaves intact.")
  sparse = [sparse_bfloat16(value) for value, _ in pairs]
  moved = []
  for (value, destination), is_sparse in zip(pairs, sparse):
    if is_sparse:
      retyped = tuple(_retyped(part, tf.float16) for part in _parts(value))
      value = (type(value)(retyped) if isinstance(
          value, values_lib.DistributedValues) else retyped[0])
    moved.append((value, destination))
  results = []
  for result, is_sparse in zip(reduce(reduce_op, moved), sparse):
    if is_sparse:
      back = tuple(_retyped(part, tf.bfloat16) for part in _parts(result))
      result = (type(result)(back) if isinstance(
          result, values_lib.DistributedValues) else back[0])
    results.append(result)
  return results
