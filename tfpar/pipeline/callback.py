"""`PipelineTrace`: profile one training step and show its schedule."""

import os

import keras
import tensorflow as tf

from tfpar._compat.tf_modules import summary_pb2
from tfpar.pipeline import render
from tfpar.pipeline import trace as trace_lib


class PipelineTrace(keras.callbacks.Callback):
  """Records one pipelined training step and reports its schedule.

  The step runs under TensorFlow's profiler, whose capture (under
  `log_dir/plugins/profile/`) opens in TensorBoard's Profile tab. From it,
  the callback reads which stage ran which micro-batch, forward or
  backward, and when, and writes to `log_dir`:

  * `schedule.png`: the swimlane picture (one lane per stage);
  * `schedule.trace.json`: the work items as Chrome trace events;
  * TensorBoard summaries: the picture as an image and the measured and
    formula bubbles as scalars.

  Args:
    log_dir: where to write.
    step: which training batch (0-based, of the first epoch) to record;
      not the first, which includes tracing.
    verbose: print the measured bubble beside the formula.

  Attributes:
    trace: the `tfpar.pipeline.trace.ScheduleTrace` once recorded.

  Example:

  >>> callback = tfpar.pipeline.PipelineTrace("/tmp/logs", step=2)  # doctest: +SKIP
  >>> model.fit(x, y, batch_size=32, callbacks=[callback])  # doctest: +SKIP
  >>> callback.trace.bubble_fraction()  # doctest: +SKIP
  0.27
  """

  def __init__(self, log_dir, step=2, verbose=True):
    super().__init__()
    if not isinstance(step, int) or step < 0:
      raise ValueError(f"step must be a batch index >= 0. Received: "
                       f"step={step!r}")
    self.log_dir = os.fspath(log_dir)
    self.step = step
    self.verbose = verbose
    self.trace = None
    self._epoch = 0
    self._active = False

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    if self._epoch == 0 and batch == self.step and self.trace is None:
      tf.profiler.experimental.start(self.log_dir)
      self._active = True

  def on_train_batch_end(self, batch, logs=None):
    if not self._active:
      return
    tf.profiler.experimental.stop()
    self._active = False
    mesh = getattr(self.model.distribute_strategy, "mesh", None)
    self.trace = trace_lib.read_xspace(
        trace_lib.latest_xspace(self.log_dir),
        mesh.shape["pipeline"] if mesh is not None else None)
    self._write()

  def on_train_end(self, logs=None):
    if self._active:  # Fewer batches than `step`.
      tf.profiler.experimental.stop()
      self._active = False

  def _write(self):
    strategy = self.model.distribute_strategy
    m = getattr(strategy, "num_microbatches", None)
    png = render.write_png(self.trace,
                           os.path.join(self.log_dir, "schedule.png"))
    self.trace.to_chrome_trace(
        os.path.join(self.log_dir, "schedule.trace.json"))
    writer = tf.summary.create_file_writer(self.log_dir)
    with writer.as_default():
      _write_image("pipeline/schedule", png, self.step)
      _write_scalar("pipeline/bubble_measured", self.trace.bubble_fraction(),
                    self.step)
      if m:
        _write_scalar("pipeline/bubble_formula", strategy.expected_bubble,
                      self.step)
    writer.close()
    if self.verbose and m:
      print(self.trace.summary(m))


# TensorBoard's image and scalar summaries, written with TF's own
# tf.summary.write so that TensorBoard need not be installed to log them.


def _metadata(plugin):
  return summary_pb2.SummaryMetadata(
      plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin))


def _write_image(tag, png_path, step):
  encoded = tf.io.read_file(png_path)
  shape = tf.shape(tf.io.decode_png(encoded))
  tensor = tf.stack([tf.strings.as_string(shape[1]),
                     tf.strings.as_string(shape[0]), encoded])
  tf.summary.write(tag, tensor, step=step,
                   metadata=_metadata("images").SerializeToString())


def _write_scalar(tag, value, step):
  tf.summary.write(tag, tf.constant(float(value), tf.float32), step=step,
                   metadata=_metadata("scalars").SerializeToString())
