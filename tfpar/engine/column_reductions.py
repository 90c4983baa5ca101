"""Reducing values held on the k-th device of every replica.

A tensor shard's or a pipeline stage's gradients live on the k-th device
(column k) of every replica; they are reduced there, by a collective of
their own per column, instead of TensorFlow's fallback that moves every
value to the replica heads one at a time ("Efficient batch_reduce is not
supported if destinations are different").
"""

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import traced_keys
from tfpar._compat.tf_modules import cross_device_ops_lib
from tfpar._compat.tf_modules import values_lib
from tfpar.engine import bfloat16_gather
from tfpar.engine import grouping


class ColumnReductions:
  """Mixin of `MeshExtended`: `batch_reduce_to` by columns."""

  def _init_column_reductions(self):
    self._column_ops = {}  # column -> its CollectiveAllReduce.

  def column_of(self, value):
    """The index within its replica group of the device holding a
    per-replica value (its column), or None."""
    if isinstance(value, values_lib.DistributedValues):
      device = value.values[0].device
    elif tf.is_tensor(value):
      device = value.device  # One replica per worker.
    else:
      return None
    if not device:
      return None
    spec = tf.DeviceSpec.from_string(device)
    for group in self._local_groups:
      for column, device in enumerate(group):
        if tf.DeviceSpec.from_string(device) == spec:
          return column
    return None

  def column_cross_device_ops(self, column):
    """The `CollectiveAllReduce` over the devices at `column` of every
    replica group (tensor shards' collectives)."""
    if column not in self._column_ops:
      self._column_ops[column] = cross_device_ops_lib.CollectiveAllReduce(
          devices=[group[column] for group in self._local_groups],
          group_size=self._mesh.num_replicas,
          options=self._communication_options,
          collective_keys=self._collective_keys)
      if not self._mesh.is_multi_worker:
        traced_keys.draw_keys_when_traced(
            distribute.launchers(self._column_ops[column]))
    return self._column_ops[column]

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    if any(bfloat16_gather.sparse_bfloat16(v)
           for v, _ in value_destination_pairs):
      return bfloat16_gather.reduce_sparse_as_float16(
          lambda op, pairs: self._batch_reduce_to(op, pairs, options),
          reduce_op, value_destination_pairs)
    values = [v for v, _ in value_destination_pairs]
    groups = grouping.reduction_groups([self.column_of(v) for v in values],
                                       values)
    if len(groups) == 1 and next(iter(groups))[0] == 0:
      return super()._batch_reduce_to(reduce_op, value_destination_pairs,
                                      options)
    results = [None] * len(value_destination_pairs)
    for (column, _), indices in groups.items():
      pairs = [value_destination_pairs[i] for i in indices]
      if column == 0:
        reduced = super()._batch_reduce_to(reduce_op, pairs, options)
      else:
        reduced = self.column_cross_device_ops(column).batch_reduce(
            reduce_op, pairs,
            options=self._communication_options.merge(options))
      for index, value in zip(indices, reduced):
        results[index] = value
    return results
