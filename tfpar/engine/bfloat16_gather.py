"""Gathers of bfloat16 values: `strategy.gather`, and the rows of sparse
gradients (an `Embedding`'s under the pure `"bfloat16"` policy).

TensorFlow's CPU collectives take no bfloat16 ("DataType bfloat16 not in
list of allowed values"), and Keras gathers `predict`'s outputs across
workers with `strategy.gather`: under `mixed_bfloat16` a model whose last
layer computes in bfloat16 could not predict across workers. The bits of a
bfloat16 tensor move as float16 (same width, nothing is converted) and are
read back as bfloat16 (`bits_as`). Stock `MirroredStrategy` fails on both.
"""

import tensorflow as tf

from tfpar._compat.tf_modules import values_lib


class Bfloat16Gather:
  """Mixin of `MeshExtended`: `strategy.gather` of bfloat16 values, and
  `reduce_to` of one bfloat16 sparse value (`strategy.reduce`)."""

  def _gather_to_implementation(self, value, destinations, axis, options):
    first = (value.values[0] if isinstance(value, values_lib.DistributedValues)
             else value)
    if getattr(first, "dtype", None) != tf.bfloat16:
      return super()._gather_to_implementation(value, destinations, axis,
                                               options)
    gathered = super()._gather_to_implementation(
        bits_as(value, tf.float16), destinations, axis, options)
    return tf.bitcast(gathered, tf.bfloat16)

  def _reduce_to(self, reduce_op, value, destinations, options):
    if not sparse_bfloat16(value):
      return super()._reduce_to(reduce_op, value, destinations, options)
    reduce_one = super()._reduce_to
    return reduce_sparse_as_float16(
        lambda op, pairs: [reduce_one(op, v, d, options) for v, d in pairs],
        reduce_op, [(value, destinations)])[0]


def bits_as(value, dtype):
  """A per-replica value (or one replica's tensor or `IndexedSlices`) with
  its bits read as `dtype`, of the same width: each component bitcast on
  its own device; an `IndexedSlices` keeps its indices and reads its
  values. A `PerReplica` or `Mirrored` value stays one; a distributed
  variable gives the `PerReplica` of its components' values."""
  if not isinstance(value, values_lib.DistributedValues):
    return _component_bits_as(value, dtype)
  kind = type(value) if type(value) in (values_lib.PerReplica,
                                        values_lib.Mirrored) else (
                                            values_lib.PerReplica)
  return kind(tuple(_component_bits_as(c, dtype) for c in value.values))


def _component_bits_as(component, dtype):
  if isinstance(component, tf.IndexedSlices):
    with tf.device(component.values.device or None):
      return tf.IndexedSlices(tf.bitcast(component.values, dtype),
                              component.indices, component.dense_shape)
  with tf.device(component.device or None):
    return tf.bitcast(component, dtype)


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
  moved = [(bits_as(value, tf.float16) if is_sparse else value, destination)
           for (value, destination), is_sparse in zip(pairs, sparse)]
  return [bits_as(result, tf.bfloat16) if is_sparse else result
          for result, is_sparse in zip(reduce(reduce_op, moved), sparse)]
