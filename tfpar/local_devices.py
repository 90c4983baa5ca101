"""Local device discovery and virtual CPU set-up.

A mesh is made of the accelerators of this host: every GPU, else every TPU
core, else the logical CPU devices. On a CPU-only host you can split the CPU
into several logical devices (TensorFlow's "virtual CPUs") to try every
parallel layout without accelerators. `tfpar launch --devices-per-worker N`
asks each worker for N virtual CPUs through the `TFPAR_DEVICES_PER_WORKER`
environment variable, which `tfpar.Mesh` honours before TensorFlow starts.
"""

import os

import tensorflow as tf

from tfpar.environment import DEVICES_PER_WORKER_ENV


def configure_virtual_cpus(count):
  """Splits this host's CPU into `count` logical devices.

  Must run before TensorFlow initializes its runtime (before the first op,
  dataset or strategy). Calling it again with the same count is a no-op.

  Args:
    count: number of logical CPU devices, at least 1.

  Returns:
    The canonical names of the logical CPU devices.

  Raises:
    ValueError: `count` is not a positive integer, or the runtime already
      started with a different number of CPU devices.

  Example:

  >>> import tfpar
  >>> tfpar.configure_virtual_cpus(4)  # doctest: +SKIP
  ('/job:localhost/replica:0/task:0/device:CPU:0', ...)
  """
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(
        f"configure_virtual_cpus needs a positive integer count. "
        f"Received: count={count!r}.")
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
  except RuntimeError:
    existing = len(tf.config.list_logical_devices("CPU"))
    if existing != count:
      raise ValueError(
          f"Cannot make {count} virtual CPU devices: TensorFlow already "
          f"started with {existing}. Call tfpar.configure_virtual_cpus "
          f"(or build the first tfpar.Mesh) before any TensorFlow op runs. "
          f"Received: count={count}.") from None
  return tuple(_canonical(f"/device:CPU:{index}") for index in range(count))


def apply_launch_environment():
  """Creates the virtual CPUs `tfpar launch` asked for, if any.

  Reads `TFPAR_DEVICES_PER_WORKER`; does nothing when it is unset or when
  the host has GPUs.

  Raises:
    ValueError: the variable is not a positive integer.
  """
  raw = os.environ.get(DEVICES_PER_WORKER_ENV)
  if not raw or tf.config.list_physical_devices("GPU"):
    return
  try:
    count = int(raw)
  except ValueError:
    count = -1
  if count < 1:
    raise ValueError(
        f"{DEVICES_PER_WORKER_ENV} must be a positive integer. "
        f"Received: {DEVICES_PER_WORKER_ENV}={raw!r}.")
  configure_virtual_cpus(count)


def local_accelerators():
  """Returns `(device_type, device_names)` for this host's compute devices.

  GPUs if there are any, else TPU cores, else the logical CPUs. Counts
  devices without starting TensorFlow's runtime, so collectives and virtual
  devices can still be configured afterwards.

  Example:

  >>> local_accelerators()  # doctest: +SKIP
  ('CPU', ('/job:localhost/replica:0/task:0/device:CPU:0',))
  """
  apply_launch_environment()
  for device_type in ("GPU", "TPU", "CPU"):
    count = 0
    for device in tf.config.list_physical_devices(device_type):
      logical = tf.config.get_logical_device_configuration(device)
      count += len(logical) if logical else 1
    if count:
      return device_type, tuple(
          _canonical(f"/device:{device_type}:{index}")
          for index in range(count))
  raise ValueError("TensorFlow reports no GPU, TPU or CPU device on this host.")


def _canonical(name):
  # Not device_util.canonicalize: it starts the runtime.
  spec = tf.DeviceSpec.from_string(name)
  return spec.make_merged_spec(
      tf.DeviceSpec(job="localhost", replica=0, task=0)).to_string()
