"""A measured machine model, and the physical bound of a benchmark's step.

The bound of a step is the time these cores need for the step's matmul
arithmetic at the matmul rate they were measured to reach, plus the time
they need to copy the step's communicated bytes at the copy bandwidth they
were measured to reach:

    bound = FLOPs / (FLOP/s of all devices together) + bytes / (bytes/s)

* FLOP/s: a chain of float32 (or bfloat16) matmuls of the benchmark's
  shape, timed (median of `runs`) on one device, and on every device at
  once (one chain per device, in one function, as a step runs). The
  larger of the two is the machine's rate: on this machine the virtual
  devices share the cores and one matmul already uses all of them, so
  running them together gives no more than min(cores, devices) cores do.
* Bytes/s: `tf.raw_ops.DeepCopy` of a large float32 tensor, on every
  device at once (the aggregate). On one host a collective between
  virtual CPUs is a memory copy (plus an add for a reduction), so every
  byte a device sends costs at least one copy. A ring all-reduce among
  the devices is timed too, as a cross-check of what a real collective
  reaches; the bound uses the copy rate.
* FLOPs: counted from the graph of one forward and backward pass of the
  model on one device with the step's global batch (`graph_flops`): every
  MatMul, BatchMatMul and two-operand Einsum, 2 x (output elements) x
  (contracted size). Element-wise ops, the loss and the optimizer are
  left out: the bound is optimistic on purpose.
* Bytes: what the benchmark counts for the step, summed over all devices.

Run as a script to print the machine model for the benchmarks' shapes:

    python benchmarks/bounds.py
"""

import os
import socket
import statistics
import threading
import time

SHAPES = {  # Rows per device x in x out of each benchmark's largest layer.
    "MLP (benchmarks 1, 6)": (64, 512, 512),
    "MLP (benchmark 2, a worker's batch; all threads)": (128, 512, 512),
    "GPT (benchmarks 3, 7)": (512, 128, 512),
    "MLP (benchmark 4)": (64, 1536, 1536),
    "Dense 1024 (benchmark 5)": (64, 1024, 1024),
    "Mixtral (benchmark 8)": (128, 64, 256),
}


def matmul_rate(shape, devices, dtype="float32", runs=7, target_flops=2e9):
  """(FLOP/s on devices[0] alone, FLOP/s of all `devices` at once) of a
  chain of (m x k) @ (k x n) @ (n x k) ... matmuls per device (the
  measurement `tfpar.TrainingMonitor` takes as a CPU's peak)."""
  from tfpar.monitor import peak  # pylint: disable=g-import-not-at-top
  return peak.matmul_rates(tuple(devices), dtype, tuple(shape), runs,
                           target_flops)


def copy_bandwidth(devices, nbytes=64 << 20, runs=7):
  """Bytes/s of `DeepCopy` of `nbytes` of float32 on every device at once
  (each device copies its own tensor; the aggregate)."""
  from tfpar.monitor import peak  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  values = []
  for d in devices:
    with tf.device(d):
      values.append(tf.random.uniform((nbytes // 4,)))

  @tf.function
  def run():
    outs = []
    for d, v in zip(devices, values):
      with tf.device(d):
        outs.append(tf.raw_ops.DeepCopy(x=v)[0])
    return tf.add_n(outs)
  return nbytes * len(devices) / peak.median_seconds(lambda: run().numpy(),
                                                    runs)


def all_reduce_bandwidth(devices, nbytes=16 << 20, runs=7):
  """Bytes/s sent, over all devices, by the ring all-reduce (TF's
  `CollectiveAllReduce`, as `tfpar.DataParallelStrategy` runs it) of
  `nbytes` per device (each device sends 2 (g-1)/g of its input)."""
  from tfpar.monitor import peak  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfpar  # pylint: disable=g-import-not-at-top
  g = len(devices)
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": g}))
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.random.uniform((nbytes // 4,)))

  @tf.function
  def run():
    summed = strategy.run(lambda v: tf.distribute.get_replica_context()
                          .all_reduce("sum", v)[:1], args=(values,))
    return strategy.reduce("sum", summed, axis=None)
  sent = ring_all_reduce_bytes(nbytes, g) * g
  return sent / peak.median_seconds(lambda: run().numpy(), runs)


def loopback_bandwidth(nbytes=256 << 20, chunk=1 << 20, runs=3):
  """Bytes/s of one TCP stream over 127.0.0.1 (what gRPC between local
  workers rides on), median of `runs`."""
  def once():
    server = socket.create_server(("127.0.0.1", 0))
    payload = b"\0" * chunk

    def send():
      with socket.create_connection(server.getsockname()) as s:
        for _ in range(nbytes // chunk):
          s.sendall(payload)
    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = server.accept()
    start, got = time.perf_counter(), 0
    while got < nbytes:
      got += len(conn.recv(chunk))
    seconds = time.perf_counter() - start
    sender.join()
    conn.close()
    server.close()
    return nbytes / seconds
  return statistics.median(once() for _ in range(runs))


def ring_all_reduce_bytes(nbytes, group):
  """Bytes one device sends in a ring all-reduce of `nbytes` per device
  over `group` devices: 2 (g - 1) / g of its input, the minimum of any
  all-reduce algorithm in the usual bandwidth model."""
  return 2 * (group - 1) * nbytes // group if group > 1 else 0


class Machine:
  """Measured FLOP/s (per dtype) and copy bytes/s for a set of devices."""

  def __init__(self, shape, devices, dtypes=("float32",), runs=7):
    self.shape, self.devices = shape, list(devices)
    self.cores = os.cpu_count()
    self.rates = {dtype: matmul_rate(shape, self.devices, dtype, runs)
                  for dtype in dtypes}
    self.bandwidth = copy_bandwidth(self.devices, runs=runs)

  def flops_per_second(self, dtype="float32"):
    return max(self.rates[dtype])

  def describe(self):
    rates = "; ".join(
        f"{dtype} matmul {self.shape[0]}x{self.shape[1]}x{self.shape[2]}: "
        f"{one / 1e9:.1f} GFLOP/s on one device, {every / 1e9:.1f} on all "
        f"{len(self.devices)} at once" for dtype, (one, every)
        in self.rates.items())
    return (f"machine model ({self.cores} cores, {len(self.devices)} "
            f"devices): {rates}; copy bandwidth (DeepCopy on every device at "
            f"once) {self.bandwidth / 1e9:.2f} GB/s")

  def bound(self, flops, nbytes, dtype="float32"):
    """(compute seconds, copy seconds, bound seconds) of a step."""
    compute = flops / self.flops_per_second(dtype)
    copy = nbytes / self.bandwidth
    return compute, copy, compute + copy


def _einsum_flops(op):
  """2 x output elements x the product of the contracted letters' sizes."""
  inputs, output = op.get_attr("equation").decode().replace(" ", "").split(
      "->")
  terms = inputs.split(",")
  if len(terms) != 2:
    return 0  # a transpose or a reduction: no multiplications
  sizes = {}
  for term, tensor in zip(terms, op.inputs):
    dims = tensor.shape.as_list()
    term = term.replace("...", "")
    sizes.update(zip(term, dims[len(dims) - len(term):]))
  contracted = 1
  for letter, size in sizes.items():
    if letter not in output:
      contracted *= size
  return 2 * op.outputs[0].shape.num_elements() * contracted


def _op_flops(op):
  if op.type == "MatMul":
    a = op.inputs[0].shape.as_list()
    k = a[0] if op.get_attr("transpose_a") else a[1]
    return 2 * op.outputs[0].shape.num_elements() * k
  if op.type.startswith("BatchMatMul"):
    a = op.inputs[0].shape.as_list()
    k = a[-2] if op.get_attr("adj_x") else a[-1]
    return 2 * op.outputs[0].shape.num_elements() * k
  if op.type == "Einsum":
    return _einsum_flops(op)
  return 0


def graph_flops(model, x, y, loss):
  """Matmul FLOPs of one forward and backward pass of `model` on `(x, y)`
  on one device, counted from the traced graph (see the module doc).
  Returns (flops, {op type: count}); raises if a matmul-like op has an
  unknown shape or the graph calls functions this count cannot see."""
  import collections  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      value = loss(y, model(x, training=True))
    return tape.gradient(value, model.trainable_variables)

  graph = step.get_concrete_function(x, y).graph
  flops, kinds = 0, collections.Counter()
  for op in graph.get_operations():
    if op.type in ("PartitionedCall", "StatefulPartitionedCall", "While",
                   "StatelessWhile", "If", "StatelessIf"):
      raise ValueError(f"graph_flops cannot see inside {op.type} {op.name}")
    n = _op_flops(op)
    if n:
      flops += n
      kinds[op.type] += 1
  return flops, dict(kinds)


def model_flops(build, x, y):
  """`graph_flops` of `build(strategy)`'s model built under the default
  strategy (one device), with its compiled loss; and `dense_flops`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  model = build(tf.distribute.get_strategy())
  flops, kinds = graph_flops(model, x, y, keras.losses.get(model.loss))
  rows = int(tf.size(y)) if len(y.shape) > 1 else int(y.shape[0])
  return flops, kinds, dense_flops(model, rows)


def dense_flops(model, rows):
  """Cross-check: 6 x (parameters of kernels of rank >= 2) x rows, the
  usual 2 forward + 4 backward FLOPs per weight and token, less the
  first layer's unneeded input gradient (not subtracted here)."""
  return 6 * rows * sum(w.shape.num_elements() for w in model.trainable_weights
                        if len(w.shape) >= 2 and "embedding" not in w.path)


def table(machine, rows, dtype_of=lambda name: "float32"):
  """Prints the bound table; rows: {name: (flops, bytes, [seconds])};
  returns {name: {...}} for the JSON output."""
  out = {}
  print("\n" + machine.describe() + "\n")
  print("| configuration | FLOPs / step | bytes moved / step | compute bound "
        "(ms) | copy bound (ms) | bound (ms) | median step (ms) | "
        "step / bound |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for name, (flops, nbytes, seconds) in rows.items():
    dtype = dtype_of(name)
    compute, copy, bound = machine.bound(flops, nbytes, dtype)
    median = statistics.median(seconds)
    out[name] = {"flops": flops, "bytes": nbytes, "dtype": dtype,
                 "compute_s": compute, "copy_s": copy, "bound_s": bound,
                 "median_step_s": median, "ratio": median / bound}
    print(f"| {name} | {flops / 1e6:,.1f} M | {nbytes:,.0f} | "
          f"{compute * 1e3:.3f} | {copy * 1e3:.3f} | {bound * 1e3:.3f} | "
          f"{median * 1e3:.2f} | {median / bound:.1f} |")
  return out


def main():
  import tfpar  # pylint: disable=g-import-not-at-top
  devices = tfpar.configure_virtual_cpus(4)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  print(f"{os.cpu_count()} cores, 4 virtual CPUs, TensorFlow {tf.__version__}")
  print("\n| matmul (rows x in x out) | dtype | GFLOP/s one device | "
        "GFLOP/s all 4 at once |")
  print("|---|---|---:|---:|")
  for name, shape in SHAPES.items():
    for dtype in ("float32", "bfloat16"):
      one, every = matmul_rate(shape, devices, dtype)
      print(f"| {name}: {'x'.join(map(str, shape))} | {dtype} | "
            f"{one / 1e9:.1f} | {every / 1e9:.1f} |", flush=True)
  print(f"\ncopy bandwidth, DeepCopy of 64 MiB on each of the 4 devices at "
        f"once: {copy_bandwidth(devices) / 1e9:.2f} GB/s; on one device: "
        f"{copy_bandwidth(devices[:1]) / 1e9:.2f} GB/s")
  print(f"ring all-reduce of 16 MiB over the 4 devices: "
        f"{all_reduce_bandwidth(devices) / 1e9:.2f} GB/s sent (all devices)")
  print(f"TCP loopback, one stream: {loopback_bandwidth() / 1e9:.2f} GB/s")


if __name__ == "__main__":
  main()
