"""Bytes of every TensorFlow variable per device, counted independently of
tfpar: each resource variable is recorded when it is constructed (through
`tf.Variable` or directly) and released when it is garbage collected."""

import collections
import contextlib
import gc
import weakref

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops


def _short(device):
  spec = tf.DeviceSpec.from_string(device)
  return f"{spec.device_type}:{spec.device_index}"


class VariableAccounting:
  """Live variable bytes per device and the peak of each, from `start()`.

  Example:

  >>> accounting = VariableAccounting()
  >>> with accounting.counting():
  ...   v = tf.Variable(tf.zeros([4]))
  >>> accounting.peak["CPU:0"]
  16
  """

  def __init__(self):
    self.live = collections.Counter()
    self.peak = collections.Counter()
    self.largest = 0  # Bytes of the largest variable seen.

  def _record(self, variable):
    try:
      nbytes = variable.shape.num_elements() * variable.dtype.size
      device = _short(variable.device)
    except (TypeError, ValueError, AttributeError):
      return
    self.largest = max(self.largest, nbytes)
    self.live[device] += nbytes
    self.peak[device] = max(self.peak[device], self.live[device])
    live = self.live
    weakref.finalize(variable, live.subtract, {device: nbytes})

  @contextlib.contextmanager
  def counting(self):
    """Records every resource variable constructed inside."""
    base = resource_variable_ops.BaseResourceVariable
    original = base.__init__
    accounting = self

    def init(variable, *args, **kwargs):
      original(variable, *args, **kwargs)
      if tf.executing_eagerly():
        accounting._record(variable)  # pylint: disable=protected-access
    base.__init__ = init
    try:
      yield self
    finally:
      base.__init__ = original
      gc.collect()

  def now(self):
    """Live bytes per device now (after a garbage collection)."""
    gc.collect()
    return {d: b for d, b in self.live.items() if b}
