"""Per-replica slices of flattened weights: the storage of every ZeRO stage.

A weight of n elements, flattened and zero-padded to a multiple of N
replicas, is cut into N slices of `ceil(n / N)` elements; replica r owns
slice r. A slice variable is a `SyncOnReadVariable` whose component r,
placed on replica r's device (or on the host with CPU offload), holds
slice r; in a replica context it reads as that replica's slice.
"""

import math

import numpy as np
import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat.keras_modules import backend
from tfpar._compat.tf_modules import resource_variable_ops
from tfpar._compat.tf_modules import values_lib
from tfpar.memory import components
from tfpar.zero import spread_slices


def slice_size(shape, replicas):
  """Elements of one replica's slice of a weight of `shape`."""
  return max(1, math.ceil(int(np.prod(shape)) / replicas))


def local_replica_ids(strategy):
  """Global replica ids of this worker's replicas, in component order."""
  extended = strategy.extended
  local = len(extended.worker_devices)
  first = distribute.id_in_cluster(extended) * local
  return list(range(first, first + local))


def padded_flat(value, length):
  """`value` flattened and zero-padded to `length` elements."""
  flat = tf.reshape(tf.convert_to_tensor(value), [-1])
  # A dense IndexedSlices gradient (an embedding's) has no static size.
  padded = tf.pad(flat, [[0, length - tf.size(flat)]])
  padded.set_shape([length])
  return padded


def flat_slice(value, replica, size, replicas):
  """Slice `replica` of `value` flattened and zero-padded (a tensor)."""
  flat = padded_flat(value, size * replicas)
  return tf.slice(flat, [replica * size], [size])


def new_slice_variable(strategy, name, dtype, devices, values,
                       trainable=False):
  """A Keras variable holding one slice per local replica.

  Args:
    strategy: the strategy whose replicas own the slices.
    name: the variable name.
    dtype: its dtype.
    devices: the device of each local replica's component.
    values: one initial slice (a vector) per local replica.
    trainable: whether gradient tapes watch the components (model
      parameters under stage 3).

  Returns:
    A `keras.Variable` of the slices' shape whose value is a
    `SyncOnReadVariable`.
  """
  components = []
  with tf.init_scope():
    for index, (device, value) in enumerate(zip(devices, values)):
      with tf.device(device):
        # Constructed directly (not through tf.Variable), so no strategy
        # creator moves it or refuses a trainable ON_READ variable.
        components.append(resource_variable_ops.ResourceVariable(
            initial_value=tf.identity(value), dtype=dtype,
            trainable=trainable, name=f"{name}/replica_{index}"))
    sliced = values_lib.SyncOnReadVariable(
        strategy, components, tf.VariableAggregation.NONE)
    return backend.Variable(sliced, trainable=trainable, name=name)


def local_component(variable):
  """The calling replica's component (in a replica context)."""
  return distribute.local_component(variable.value)


def whole(slice_variable, shape, parts=None, column=0):
  """The full-shape NumPy value of a sliced variable (of `parts`, its
  components holding the slices, when not all of them: SPMD tensor
  column `column`'s).

  In a multi-worker job whose slices are spread over the workers, this
  gathers them from every worker: a collective (see `spread_slices`).
  """
  if spread_slices.is_spread(slice_variable):
    flat = spread_slices.whole_flat(slice_variable, column)
  else:
    flat = np.concatenate([np.asarray(c.read_value()) for c in (
        components(slice_variable) if parts is None else parts)])
  return flat[:int(np.prod(shape))].reshape(shape)


def assign_whole(slice_variable, value, replicas, replica_ids, parts=None):
  """Splits a full-shape value into the slices of this host's replicas
  (into `parts`, as for `whole`)."""
  value = np.asarray(value)
  parts = components(slice_variable) if parts is None else parts
  size = parts[0].shape[0]
  if value.size > size * replicas:
    raise ValueError(
        f"Cannot assign {value.size} elements to a tensor sliced into "
        f"{replicas} slices of {size}.")
  flat = np.pad(value.reshape(-1), (0, size * replicas - value.size))
  for replica, component in zip(replica_ids, parts):
    component.assign(flat[replica * size:(replica + 1) * size])
