"""The peak FLOP/s that MFU is measured against.

In order: the user's `peak_flops` (per device), a table of known
accelerators (dense 16-bit and float32 tensor-core peaks per device, from
the vendors' data sheets; float32 on Ampere and later is TF32, which
TensorFlow uses by default), else on CPU the measured matmul rate of the
step's devices together (virtual CPU devices share the cores, so the
machine's rate, not a rate per device).
"""

import functools
import statistics
import time

import tensorflow as tf

# (name fragment of the GPU's device_name, 16-bit peak, float32 peak), per
# device, dense; tried in order.
KNOWN_ACCELERATORS = (
    ("h100 pcie", 756e12, 378e12),
    ("h100", 989e12, 494e12),
    ("a100", 312e12, 156e12),
    ("l4", 121e12, 60e12),
    ("v100", 125e12, 15.7e12),
    ("t4", 65e12, 8.1e12),
)
_SIXTEEN_BITS = ("bfloat16", "float16")


def table_peak(device_name, dtype):
  """Per-device peak FLOP/s of a known accelerator, or None.

  Args:
    device_name: the GPU's name (`tf.config.experimental.get_device_details`
      `["device_name"]`), e.g. "NVIDIA A100-SXM4-40GB".
    dtype: the matmuls' dtype name.

  Example:

  >>> table_peak("NVIDIA A100-SXM4-40GB", "bfloat16")
  312000000000000.0
  >>> table_peak("some CPU", "float32") is None
  True
  """
  name = device_name.lower()
  for fragment, sixteen, thirty_two in KNOWN_ACCELERATORS:
    if fragment in name:
      return sixteen if dtype in _SIXTEEN_BITS else thirty_two
  return None


def median_seconds(fn, runs):
  """Median seconds of `runs` calls of `fn` after one untimed call (which
  traces and warms up).

  Args:
    fn: what to time, called with no arguments.
    runs: timed calls.

  Example:

  >>> median_seconds(lambda: sum(range(100)), runs=3) >= 0
  True
  """
  fn()  # Trace and warm up.
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


@functools.lru_cache(maxsize=None)
def measured_rate(devices, dtype="float32", shape=(256, 1024, 1024), runs=5,
                  target_flops=2e9):
  """FLOP/s of a chain of matmuls: the larger of one device alone and every
  device at once (one chain each, in one function), as
  benchmarks/bounds.py measures it. Cached per process.

  Args:
    devices: a tuple of device names.
    dtype: the matmuls' dtype name.
    shape: (m, k, n) of the chain's (m x k) @ (k x n) @ (n x k) pairs.
    runs: timed runs (the median counts).
    target_flops: FLOPs per timed run, over all devices.

  Example:

  >>> measured_rate(("/device:CPU:0",), shape=(32, 32, 32), runs=1,
  ...               target_flops=1e6) > 0
  True
  """
  return max(matmul_rates(devices, dtype, shape, runs, target_flops))


def matmul_rates(devices, dtype="float32", shape=(256, 1024, 1024), runs=5,
                 target_flops=2e9):
  """(FLOP/s on devices[0] alone, FLOP/s of all `devices` at once) of a
  chain of (m x k) @ (k x n) @ (n x k) matmuls per device (arguments as
  `measured_rate`'s; benchmarks/bounds.py reads it too).

  Example:

  >>> one, every = matmul_rates(("/device:CPU:0",), shape=(32, 32, 32),
  ...                           runs=1, target_flops=1e6)
  >>> one > 0 and every > 0
  True
  """
  m, k, n = shape
  pair = 2 * (2 * m * k * n)
  reps = max(1, int(target_flops / pair / len(devices)))
  rng = tf.random.Generator.from_seed(0)
  data = []
  for device in devices:
    with tf.device(device):
      data.append([tf.cast(rng.normal(s), dtype)
                   for s in ((m, k), (k, n), (n, k))])

  def chains(which):
    @tf.function
    def run():
      outs = []
      for i in which:
        with tf.device(devices[i]):
          x, w1, w2 = data[i]
          for _ in range(reps):
            x = tf.matmul(tf.matmul(x, w1), w2) * tf.cast(0.01, dtype)
          outs.append(tf.reduce_sum(tf.cast(x[:1, :1], tf.float32)))
      return tf.add_n(outs)
    return lambda: run().numpy()

  one = pair * reps / median_seconds(chains([0]), runs)
  every = (pair * reps * len(devices) /
           median_seconds(chains(range(len(devices))), runs))
  return one, every


def step_peak(devices, dtype, peak_flops=None):
  """(peak FLOP/s of `devices` together, where it came from), or
  (None, "unknown").

  Args:
    devices: the step's device names.
    dtype: the dtype most of the step's FLOPs are in.
    peak_flops: the user's peak per device, or None.

  Example:

  >>> step_peak(["/device:CPU:0", "/device:CPU:1"], "float32", 1e12)
  (2000000000000.0, 'given')
  """
  devices = tuple(devices)
  if peak_flops is not None:
    return float(peak_flops) * len(devices), "given"
  types = {tf.DeviceSpec.from_string(d).device_type for d in devices}
  if types == {"GPU"}:
    gpus = tf.config.list_physical_devices("GPU")
    name = tf.config.experimental.get_device_details(gpus[0]).get(
        "device_name", "") if gpus else ""
    per_device = table_peak(name, dtype)
    if per_device is None:
      return None, "unknown"
    return per_device * len(devices), f"table: {name}"
  if types == {"CPU"}:
    return measured_rate(devices, dtype), "measured CPU matmul rate"
  return None, "unknown"
