"""Memory per device for `TrainingMonitor`: the allocator's current and
peak bytes where TensorFlow tracks them (GPUs, TPUs), else the bytes of
the model's and optimizer's variables on each device (`memory_report`),
labelled as such: TensorFlow's CPU allocator is one for every CPU
device (and reports zeros until something enables its statistics)."""

import tensorflow as tf

from tfpar import memory

ALLOCATOR = "allocator"
VARIABLES = "variables"
# Virtual CPU devices share one allocator, whose numbers are the process's,
# not a device's.
_TRACKED = ("GPU", "TPU")


def _allocator(device):
  spec = tf.DeviceSpec.from_string(device)
  if spec.device_type not in _TRACKED:
    return None
  try:
    info = tf.config.experimental.get_memory_info(
        f"{spec.device_type}:{spec.device_index}")
  except (ValueError, RuntimeError, tf.errors.OpError):
    return None
  if not info or not info.get("peak"):
    return None  # Untracked (CPU).
  return int(info["current"]), int(info["peak"])


def device_memory(model, devices):
  """(source, {device: (current bytes, peak bytes or None)}).

  Args:
    model: the Keras model being trained.
    devices: canonical device names.

  Returns:
    source "allocator" with both numbers per device, or "variables" with
    the bytes of variables per device and no peak.

  Example:

  >>> import keras
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  >>> device = model.weights[0].value.device
  >>> device_memory(model, [device])[1][device]
  (40, None)
  """
  found = {device: _allocator(device) for device in devices}
  if devices and all(found.values()):
    return ALLOCATOR, found
  report = memory.memory_report(model)
  held = {}
  for device in report.devices:
    name = tf.DeviceSpec.from_string(device).to_string()
    held[name] = held.get(name, 0) + report.total(device)
  return VARIABLES, {device: (held.get(device, 0), None)
                     for device in devices}
