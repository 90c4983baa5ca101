"""Sequence parallelism: position-wise layers run on sequence slices.

With `sequence_parallel=True` a row-parallel layer leaves its output split
along the sequence, slice k on device k (reduce-scatter). The functional
model's position-wise operations that follow (LayerNormalization, dropout,
residual adds, elementwise activations) then run slice by slice, each on
its device, until a column-parallel layer all-gathers the whole sequence.
The activations of those regions take 1/tensor of the memory per device.
"""

import keras
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat.keras_modules import keras_ops
from tfpar._compat.keras_modules import tree
from tfpar.tensor_parallel import comm
from tfpar.tensor_parallel import compute
from tfpar.tensor_parallel import tags

_POSITION_WISE = (
    keras.layers.Activation, keras.layers.Add, keras.layers.Subtract,
    keras.layers.Multiply, keras.layers.ReLU, keras_ops.numpy.Add,
    keras_ops.numpy.Subtract, keras_ops.numpy.Multiply,
)


def is_position_wise(operation, dropout=True):
  """Whether `operation` computes each position of the sequence alone
  (with `dropout`, `Dropout` counts as such)."""
  if dropout and isinstance(operation, keras.layers.Dropout):
    return True
  if isinstance(operation, keras.layers.LayerNormalization):
    axes = operation.axis if isinstance(operation.axis, (list, tuple)) else [
        operation.axis]
    return all(a == -1 or a >= 2 for a in axes)
  return type(operation) in _POSITION_WISE


def _run_in_slices(operation, call, group, args, kwargs):
  devices = group()
  leaves = [x for x in tree.flatten((args, kwargs)) if tf.is_tensor(x)]
  chunks = [tags.sequence_chunks(x, devices) for x in leaves]
  if not leaves or any(c is None for c in chunks):
    return call(*args, **kwargs)

  outs = []
  for index, device in enumerate(devices):
    def on_slice(*pieces):
      it = iter(pieces)
      new_args, new_kwargs = tree.map_structure(
          lambda x: next(it) if tf.is_tensor(x) else x, (args, kwargs))
      return call(*new_args, **new_kwargs)
    outs.append(compute.on_device(device, on_slice,
                                  *[c[index] for c in chunks]))
  name = getattr(operation, "name", type(operation).__name__)
  whole = comm.gather(outs, tags.SEQUENCE_AXIS, devices, name)
  return tags.tag_sequence(whole, outs, devices)


def install(model, group):
  """Makes a functional model run its position-wise operations on sequence
  slices when their inputs arrive split.

  Args:
    model: a functional (or Sequential) Keras model.
    group: a function returning the current replica's devices.
  """
  if getattr(model, "_tfpar_sequence", False):
    return

  def sliced(operation, call):
    if not is_position_wise(operation):
      return call
    return lambda *args, **kwargs: _run_in_slices(
        operation, call, group, args, kwargs)

  if keras_layers.wrap_graph_calls(model, sliced):
    object.__setattr__(model, "_tfpar_sequence", True)
