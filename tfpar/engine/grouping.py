"""Which values one cross-replica reduction may batch together.

TensorFlow packs a batch of values into one tensor per collective, so a
batch must share a device column (the k-th device of every replica: a
tensor shard's or a pipeline stage's values are reduced where they live)
and a dtype (a model with float16 and float32 weights has gradients of
both, which would not concatenate: "Tensors in list passed to 'values' of
'ConcatV2' Op have types [float32, float16, ...]").
"""

from tfpar._compat.tf_modules import values_lib


def dtype_of(value):
  """The dtype of a tensor or of a per-replica value's components."""
  if isinstance(value, values_lib.DistributedValues):
    value = value.values[0]
  return getattr(value, "dtype", None)


def reduction_groups(columns, values):
  """{(column, dtype): [indices]} in first-seen order.

  Args:
    columns: the device column of each value (None: the replica heads).
    values: the values.

  Example:

  >>> import tensorflow as tf
  >>> reduction_groups([0, None, 1], [tf.constant(1.), tf.constant(2),
  ...                                 tf.constant(3.)])
  {(0, tf.float32): [0], (0, tf.int32): [1], (1, tf.float32): [2]}
  """
  groups = {}
  for index, (column, value) in enumerate(zip(columns, values)):
    groups.setdefault((column or 0, dtype_of(value)), []).append(index)
  return groups
