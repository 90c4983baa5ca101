"""`tfpar.TrainingMonitor`: throughput, FLOPs and MFU, collective bytes and
bus bandwidth, and memory per device, every k training steps."""

import time

import keras
import tensorflow as tf

from tfpar.monitor import csv_log
from tfpar.monitor import flops as flops_lib
from tfpar.monitor import memory_stats
from tfpar.monitor import peak as peak_lib
from tfpar.monitor import report as report_lib
from tfpar.monitor import step_graph
from tfpar.monitor import tensorboard_log


def _check(every, csv_path, log_dir, peak_flops):
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise ValueError(f"TrainingMonitor: every must be a positive integer "
                     f"(report every that many steps). Received: "
                     f"every={every!r}")
  for name, value in (("csv_path", csv_path), ("log_dir", log_dir)):
    if value is not None and not (isinstance(value, str) and value):
      raise ValueError(f"TrainingMonitor: {name} must be a non-empty path "
                       f"string or None. Received: {name}={value!r}")
  if peak_flops is not None and (
      isinstance(peak_flops, bool) or
      not isinstance(peak_flops, (int, float)) or not peak_flops > 0):
    raise ValueError(f"TrainingMonitor: peak_flops must be a positive "
                     f"number (FLOP/s of one device) or None. Received: "
                     f"peak_flops={peak_flops!r}")


def _batch_sizes(data):
  """(rows, tokens per row or None) of one replica's batch, if static."""
  x = data[0] if isinstance(data, (tuple, list)) else data
  if isinstance(x, dict):
    first = x.get("token_ids", next(iter(x.values()), None))
  else:
    first = (tf.nest.flatten(x) or [None])[0]
  shape = getattr(first, "shape", None)
  if shape is None or shape.rank is None or shape.rank < 1:
    return None, None
  rows = shape[0]
  tokens = None
  if shape.rank == 2 and first.dtype.is_integer:
    tokens = shape[1]
  return rows, tokens


class TrainingMonitor(keras.callbacks.Callback):
  """Every `every` steps: samples (or tokens) per second, step time, the
  step's FLOPs counted from its traced graph, MFU, bytes and bus bandwidth
  of each collective kind, and memory per device; added to Keras's logs
  (the progress bar shows them), written to `csv_path` and to TensorBoard
  under `log_dir`.

  Step times are measured from batch begin to batch end, leaving out steps
  that traced the function; bandwidth is bytes per step over the step time
  (the collectives run during part of it, so the link ran at least that
  fast). FLOPs are those of the matrix products of this process's devices
  (docs/monitor.md says what is counted). A stock `MirroredStrategy`
  copies between devices outside collectives: its bytes are "unknown".

  Args:
    every: steps between reports.
    csv_path: the CSV file to write (the chief writes), or None.
    log_dir: a TensorBoard log directory (the chief writes), or None.
    peak_flops: peak FLOP/s of one device for MFU. Default: a table of
      known GPUs, or on CPU the measured matmul rate of the step's devices
      together (measured once per process, about a second).

  Example:

  >>> import keras, numpy as np, tfpar
  >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
  >>> model.compile(optimizer="sgd", loss="mse")
  >>> monitor = tfpar.TrainingMonitor(every=2, peak_flops=1e11)
  >>> history = model.fit(np.ones((64, 8)), np.ones((64, 4)), batch_size=8,
  ...                     callbacks=[monitor], verbose=0)
  >>> monitor.last["flops_per_step"]  # forward 2x8x8x4 + weight gradient
  1024
  """

  def __init__(self, every=10, csv_path=None, log_dir=None, peak_flops=None):
    super().__init__()
    _check(every, csv_path, log_dir, peak_flops)
    self.every = every
    self.csv_path = csv_path
    self.log_dir = log_dir
    self.peak_flops = peak_flops
    self.last = None  # The last report's row.
    self.rows = []
    self._csv = csv_log.CsvLog(csv_path) if csv_path else None
    self._tensorboard = None
    self._traces = []  # (graph, rows per replica, tokens per row).
    self._analysed = None  # (graph, StepCount or None, rows, tokens).
    self._cached_facts = None  # (id of the analysed graph, _facts()).
    self._step = 0
    self._reset_interval()
    self._traced_in_batch = False
    self._batch_start = None

  def _reset_interval(self):
    self._seconds = 0.0
    self._timed_steps = 0

  def set_model(self, model):
    super().set_model(model)
    step = model.train_step
    if getattr(step, "tfpar_monitor", None) is self:
      return

    def train_step(data):
      rows, tokens = _batch_sizes(data)
      self._traces.append((tf.compat.v1.get_default_graph(), rows, tokens))
      self._traced_in_batch = True
      return step(data)
    train_step.tfpar_monitor = self
    object.__setattr__(model, "train_step", train_step)
    if model.train_function is not None:  # Traced without the hook.
      model.train_function = None

  def on_train_batch_begin(self, batch, logs=None):
    self._batch_begin = batch
    self._batch_start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    seconds = time.perf_counter() - self._batch_start
    steps = batch - self._batch_begin + 1
    self._step += steps
    if self._traced_in_batch:
      self._traced_in_batch = False  # Tracing time is not step time.
    else:
      self._seconds += seconds
      self._timed_steps += steps
    crossed = self._step // self.every > (self._step - steps) // self.every
    if not crossed or not self._timed_steps:
      return
    row = self._report()
    self._reset_interval()
    if logs is not None:
      logs.update(report_lib.progress_values(row))

  def _step_count(self):
    """(StepCount or None, samples, tokens) of the latest trace whose
    shapes are static (a last partial batch retraces with a dynamic one)."""
    for graph, rows, tokens in reversed(self._traces):
      if self._analysed is not None and self._analysed[0] is graph:
        return self._analysed[1:]
      try:
        count = step_graph.count_graph(graph)
      except (flops_lib.UnknownShape, ValueError):
        continue
      replicas = self.model.distribute_strategy.num_replicas_in_sync
      samples = None if rows is None else rows * replicas
      tokens = None if tokens is None or samples is None else (
          samples * tokens)
      self._analysed = (graph, count, samples, tokens)
      return count, samples, tokens
    return None, None, None

  def _devices(self, count):
    try:
      devices = self.model.distribute_strategy.extended.worker_devices
    except RuntimeError:  # The default strategy: one device.
      devices = [(tf.config.list_logical_devices("GPU") or
                  tf.config.list_logical_devices("CPU"))[0].name]
    devices = [step_graph.canonical_device(d) for d in devices]
    if count is not None and count.flops:
      named = sorted(d for d in count.flops if d)
      devices = named or devices[:1]
    return devices

  def _facts(self):
    """What stays fixed while the traced step does: (count, samples,
    tokens, peak, known), computed once per trace."""
    count, samples, tokens = self._step_count()
    key = None if self._analysed is None else id(self._analysed[0])
    if self._cached_facts is not None and self._cached_facts[0] == key:
      return self._cached_facts[1]
    devices = self._devices(count)
    peak = None
    if count is not None and count.dtypes:
      dtype = max(count.dtypes, key=count.dtypes.get)
      peak, _ = peak_lib.step_peak(devices, dtype, self.peak_flops)
    # Collective strategies (tfpar's, MultiWorkerMirrored) move their
    # bytes in the collectives counted; stock Mirrored copies between
    # devices outside them.
    known = count is not None and (len(devices) == 1 or isinstance(
        self.model.distribute_strategy,
        tf.distribute.MultiWorkerMirroredStrategy))
    memory = memory_stats.device_memory(self.model, devices)
    facts = (count, samples, tokens, devices, peak, known, memory)
    self._cached_facts = (key, facts)
    return facts

  def _report(self):
    count, samples, tokens, devices, peak, known, memory = self._facts()
    if memory[0] != memory_stats.VARIABLES:  # The allocator's: read anew.
      memory = memory_stats.device_memory(self.model, devices)
    row = report_lib.build(
        self._step, self._seconds / self._timed_steps, samples, tokens,
        count, peak, known, memory)
    self.last = row
    self.rows.append(row)
    if self.model.distribute_strategy.extended.should_checkpoint:
      self._write(row)
    return row

  def _write(self, row):
    if self._csv is not None:
      self._csv.write(row)
    if self.log_dir is not None:
      if self._tensorboard is None:
        self._tensorboard = tensorboard_log.TensorBoardLog(self.log_dir)
      self._tensorboard.write(row)

  def on_epoch_end(self, epoch, logs=None):
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def on_train_end(self, logs=None):
    if self._tensorboard is not None:
      self._tensorboard.flush()
