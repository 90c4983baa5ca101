"""Sparse gradients under ZeRO, applied as plain data parallelism does.

An `Embedding` gives `IndexedSlices` gradients: rows, with a row repeated
once per occurrence of its token. Keras applies them sparsely on one device
and under `MirroredStrategy` (whose all-reduce of `IndexedSlices`
concatenates every replica's rows): Adam's second moment then adds the
square of each occurrence, not the square of their sum. Densifying first,
as a reduce-scatter must, gives a different (if arguably better) update.

So, by default, ZeRO stages 1-2 all-gather the rows of a sparse gradient,
as MirroredStrategy does, and each replica keeps the elements that fall in
its slice of the flattened weight, still one entry per occurrence: the
optimizer's `update_step` then sees what it sees under MirroredStrategy,
restricted to the slice. Stage 3 does the same in the backward pass of
the gathered weight. With clipping (`clipnorm`, `global_clipnorm`,
`clipvalue`) ZeRO clips dense slices, so sparse gradients are densified.
"""

import tensorflow as tf

from tfpar.zero import collectives


def slice_of_rows(rows, width, replica, size):
  """The entries of gathered gradient rows inside one replica's slice.

  Args:
    rows: an `IndexedSlices` of rows of a weight, every replica's.
    width: elements per row (the weight's size over its first dimension).
    replica: the replica whose slice to keep.
    size: elements per slice.

  Returns:
    An `IndexedSlices` over the slice (dense shape `[size]`): one entry per
    element of every row that falls in the slice, repeats kept.

  Example:

  >>> rows = tf.IndexedSlices(tf.constant([[1., 2.], [3., 4.], [5., 6.]]),
  ...                         tf.constant([0, 1, 0]), tf.constant([2, 2]))
  >>> part = slice_of_rows(rows, 2, replica=1, size=2)
  >>> part.indices.numpy().tolist(), part.values.numpy().tolist()
  ([0, 1], [3.0, 4.0])
  """
  values = tf.reshape(rows.values, [-1])
  positions = (tf.cast(rows.indices, tf.int64)[:, None] * width +
               tf.range(width, dtype=tf.int64)[None, :])
  start = tf.cast(replica, tf.int64) * size
  positions = tf.reshape(positions, [-1]) - start
  inside = tf.logical_and(positions >= 0, positions < size)
  return tf.IndexedSlices(tf.boolean_mask(values, inside),
                          tf.boolean_mask(positions, inside),
                          tf.constant([size], tf.int64))


def sliced_sparse_gradient(grad, weight_shape, name, column, size,
                           phase=collectives.OPTIMIZER):
  """This replica's slice of a sparse gradient, summed over replicas as
  MirroredStrategy sums `IndexedSlices` (see the module docstring)."""
  context = tf.distribute.get_replica_context()
  rows = collectives.all_gather_rows(grad, phase, name, column)
  width = int(weight_shape[1:].num_elements()) if len(weight_shape) > 1 else 1
  return slice_of_rows(rows, width, context.replica_id_in_sync_group, size)
