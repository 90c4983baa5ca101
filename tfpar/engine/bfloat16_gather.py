"""Cross-worker gathers of bfloat16 values.

TensorFlow's CPU collectives take no bfloat16 ("DataType bfloat16 not in
list of allowed values"), and Keras gathers `predict`'s outputs across
workers with `strategy.gather`: under `mixed_bfloat16` a model whose last
layer computes in bfloat16 could not predict across workers. The bits of a
bfloat16 tensor move as float16 (same width, nothing is converted) and are
read back as bfloat16.
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
