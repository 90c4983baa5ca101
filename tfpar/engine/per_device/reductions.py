"""`PerDeviceReductions`: how SPMD tensor parallelism reduces values that
have one component per device (`data x tensor` of them).

Gradients and other per-device values are reduced within each tensor
column (the k-th devices of every group), over the data replicas: shard
k's gradients over the devices holding shard k, a replicated weight's
copies alike on every column. Values reduced to one destination take the
first column's (every column's are equal by construction).
"""

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat.tf_modules import nest
from tfpar._compat.tf_modules import values_lib
from tfpar.engine.per_device import collectives


def _components(value):
  if isinstance(value, values_lib.DistributedValues):
    return value.values
  return (value,)


class PerDeviceReductions:
  """Mixin of `PerDeviceExtended` (before TensorFlow's extended
  in the MRO); needs its `_groups` and `tensor_size`."""

  def _is_per_device(self, value):
    """Whether `value` has one component per data x tensor device."""
    return (self.tensor_size > 1 and
            isinstance(value, values_lib.DistributedValues) and
            len(value.values) == len(self._groups.devices))

  def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
    """Without merge_call (gradient accumulation's update micro-step), a
    trace all-reduces over the data replicas within the device column of
    each value (its tensor column; under SPMD 3D, that column of the
    value's stage)."""
    slot = collectives.current_slot()
    if slot is None or not self.merge_free_active():
      return super()._replica_ctx_all_reduce(reduce_op, value, options)
    flat = nest.flatten(value)
    options = self._communication_options.merge(
        options or tf.distribute.experimental.CommunicationOptions())
    by_column = {}
    for index, item in enumerate(flat):
      column = self.column_of(item)
      by_column.setdefault(slot.tensor_index if column is None else column,
                           []).append(index)
    reduced = [None] * len(flat)
    for column, indices in by_column.items():
      ops = (self._cross_device_ops if column == 0 else
             self.column_cross_device_ops(column))
      for index, item in zip(indices, distribute.all_reduce(
          ops, reduce_op, [flat[i] for i in indices],
          slot.device_index // self.tensor_size, options)):
        reduced[index] = item
    return nest.pack_sequence_as(value, reduced)

  def _column_values(self, value, column):
    """The components of per-device `value` on the `column`-th device of
    every group (variables read), as per-replica values."""
    t = self.tensor_size
    return values_lib.PerReplica(tuple(
        tf.convert_to_tensor(v) if isinstance(v, tf.Variable) else v
        for v in value.values[column::t]))

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    if not value_destination_pairs or not all(
        self._is_per_device(v) for v, _ in value_destination_pairs):
      return super()._batch_reduce_to(reduce_op, value_destination_pairs,
                                      options)
    t = self.tensor_size
    to_every_device = [
        isinstance(d, values_lib.DistributedValues) and
        len(d.values) == len(self._groups.devices)
        for _, d in value_destination_pairs]
    if not all(to_every_device):
      return [self._reduce_to(reduce_op, v, d, options)
              for v, d in value_destination_pairs]
    pairs = []
    for column in range(t):
      for value, _ in value_destination_pairs:
        part = self._column_values(value, column)
        pairs.append((part, part))
    reduced = super()._batch_reduce_to(reduce_op, pairs, options)
    count = len(value_destination_pairs)
    results = []
    for index in range(count):
      columns = [_components(reduced[column * count + index])
                 for column in range(t)]
      results.append(values_lib.Mirrored(tuple(
          columns[k][d] for d in range(len(self._groups.groups))
          for k in range(t))))
    return results

  def _reduce_to(self, reduce_op, value, destinations, options):
    if not self._is_per_device(value):
      return super()._reduce_to(reduce_op, value, destinations, options)
    if (isinstance(destinations, values_lib.DistributedValues) and
        len(destinations.values) == len(self._groups.devices)):
      return self._batch_reduce_to(reduce_op, [(value, destinations)],
                                   options)[0]
    return super()._reduce_to(reduce_op, self._column_values(value, 0),
                              destinations, options)
