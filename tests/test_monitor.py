"""tfpar.TrainingMonitor against independent counts: the step's FLOPs
counted by hand (2 m k n per matmul forward, and the backward's), the
all-reduce's bytes as the gradients' bytes, memory as the bytes of every
variable per device, MFU and bandwidth recomputed from the step time; the
CSV, TensorBoard's events, Keras's logs, the plot and the recipe switch."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import stock_strategies
import tfpar
from tfpar import cli
from tfpar.monitor import csv_log
from tfpar.monitor import peak as peak_lib
from tfpar.monitor import plot
from tfpar.monitor import step_graph
from tfpar.recipes import build as recipe_build
from tfpar.recipes import schema

SIZES = (16, 32, 8)  # in -> hidden (relu) -> out
BATCH, STEPS, EVERY = 32, 4, 2
PEAK = 1e11


def _mlp():
  model = keras.Sequential([keras.Input((SIZES[0],)),
                            keras.layers.Dense(SIZES[1], activation="relu"),
                            keras.layers.Dense(SIZES[2])])
  model.compile(optimizer=keras.optimizers.SGD(
      0.1, gradient_accumulation_steps=2), loss="mse")
  return model


def _plain_mlp(out):
  model = keras.Sequential([keras.Input((SIZES[0],)),
                            keras.layers.Dense(SIZES[1], activation="relu"),
                            keras.layers.Dense(out)])
  model.compile(optimizer="sgd", loss="mse")
  return model


def _hand_flops(rows, sizes=SIZES):
  """Forward 2 m k n per layer; backward a weight gradient per layer and
  an input gradient for every layer but the first."""
  (a, b), (c, d) = (sizes[0], sizes[1]), (sizes[1], sizes[2])
  forward = 2 * rows * a * b + 2 * rows * c * d
  return forward + forward + 2 * rows * c * d


class _Logs(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.seen = []

  def on_train_batch_end(self, batch, logs=None):
    self.seen.append(dict(logs or {}))


def _fit(strategy, monitor, model_fn=_mlp, x=None, y=None):
  with strategy.scope():
    model = model_fn()
  x = np.random.RandomState(0).rand(BATCH * STEPS, SIZES[0]).astype(
      "float32") if x is None else x
  if y is None:
    y = np.ones((len(x), model.output_shape[-1]), "float32")
  logs = _Logs()
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
            callbacks=[monitor, logs])
  return model, logs


def _variable_bytes_per_device(model):
  """Bytes of every variable's copy on each device, counted from the
  variables themselves."""
  held = {}
  for variable in model.variables + model.optimizer.variables:
    value = variable.value
    copies = getattr(value, "values", (value,))
    for copy in copies:
      device = tf.DeviceSpec.from_string(copy.device).to_string()
      held[device] = held.get(device, 0) + copy.numpy().nbytes
  return held


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
  folder = tmp_path_factory.mktemp("monitor")
  monitor = tfpar.TrainingMonitor(
      every=EVERY, csv_path=str(folder / "run.csv"),
      log_dir=str(folder / "logs"), peak_flops=PEAK)
  model, logs = _fit(tfpar.DataParallelStrategy(), monitor)
  return monitor, model, logs, folder


def test_data_parallel_numbers_match_independent_counts(data_parallel):
  monitor, model, logs, _ = data_parallel
  assert [row["step"] for row in monitor.rows] == [2, 4]
  row = monitor.last
  devices = 4
  assert row["flops_per_step"] == _hand_flops(BATCH) == 114_688
  # The gradients' all-reduce (inside the accumulation's tf.cond): their
  # bytes, on each device; a ring of 4 sends 2 x 3/4 of them.
  gradient_bytes = sum(int(np.prod(w.shape)) * 4
                       for w in model.trainable_weights)
  assert row["all-reduce_bytes"] == gradient_bytes == 3232
  seconds = row["step_time_s"]
  assert row["all-reduce_busbw"] == pytest.approx(
      gradient_bytes * 1.5 / seconds)
  assert row["all-reduce_algbw"] == pytest.approx(gradient_bytes / seconds)
  assert row["all-gather_bytes"] == row["all-to-all_bytes"] == 0
  assert row["samples_per_sec"] == pytest.approx(BATCH / seconds)
  assert row["tokens_per_sec"] is None
  assert row["mfu"] == pytest.approx(
      _hand_flops(BATCH) / seconds / (PEAK * devices))
  assert row["memory_source"] == "variables"
  held = _variable_bytes_per_device(model)
  assert len(held) == devices
  for device, nbytes in held.items():
    assert row[f"memory_current:CPU:{device[-1]}"] == nbytes
  # Keras's logs (the progress bar's) carry the numbers on report steps.
  assert "mfu" not in logs.seen[0]
  shown = logs.seen[-1]
  assert shown["mfu"] == pytest.approx(row["mfu"])
  assert shown["step_ms"] == pytest.approx(seconds * 1e3)
  assert shown["all_reduce_busbw_GBps"] == pytest.approx(
      row["all-reduce_busbw"] * 1e-9)


def test_csv_tensorboard_and_plot(data_parallel, tmp_path):
  monitor, _, _, folder = data_parallel
  rows = csv_log.read(str(folder / "run.csv"))
  assert len(rows) == 2
  for written, row in zip(rows, monitor.rows):
    for key, value in row.items():
      if isinstance(value, (int, float)):
        assert written[key] == pytest.approx(value), key
  steps = {}
  for name in os.listdir(folder / "logs"):
    for event in tf.compat.v1.train.summary_iterator(
        str(folder / "logs" / name)):
      for value in event.summary.value:
        steps.setdefault(value.tag, []).append(event.step)
  assert steps["monitor/mfu"] == [2, 4]
  assert steps["monitor/all-reduce_busbw"] == [2, 4]
  # The plot, drawn the way this machine can (matplotlib or the bitmap).
  png = str(tmp_path / "run.png")
  assert cli.main(["monitor", "plot", str(folder / "run.csv"), "-o",
                   png]) == 0
  image = tf.io.decode_png(tf.io.read_file(png)).numpy()
  assert image.shape[0] > 300 and image.shape[1] > 300
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:  # Bitmap: each of the 3 panels has its line drawn.
    line = np.all(image[..., :3] == plot.LINE, axis=-1)
    rows_with_line = np.nonzero(line.any(axis=1))[0]
    assert len(rows_with_line) > 0
    panel = plot._PANEL + plot._GAP  # pylint: disable=protected-access
    assert {(r - 20) // panel for r in rows_with_line} == {0, 1, 2}
  with pytest.raises(SystemExit):
    cli.main(["monitor", "plot", str(tmp_path / "missing.csv")])


def test_tensor_parallel_spmd_step():
  # data 2 x tensor 2: each device traces its share; the counts add up to
  # one device's, and each device all-reduces its layer-2 partial output
  # over the tensor group and its gradient shards over the data group.
  monitor = tfpar.TrainingMonitor(every=EVERY, peak_flops=PEAK)
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}))
  model, _ = _fit(strategy, monitor, lambda: _plain_mlp(SIZES[0]))
  row = monitor.last
  sizes = (SIZES[0], SIZES[1], SIZES[0])
  assert row["flops_per_step"] == _hand_flops(BATCH, sizes)
  activation = (BATCH // 2) * sizes[2] * 4
  shards = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_variables)
  assert row["all-reduce_bytes"] == activation + shards == 1024 + 2176
  assert row["all-reduce_busbw"] == pytest.approx(  # Groups of 2: x 1.
      row["all-reduce_algbw"])


def test_one_device_and_stock_mirrored():
  # No strategy: one device, no collectives; the peak is the measured CPU
  # matmul rate.
  monitor = tfpar.TrainingMonitor(every=EVERY)
  _fit(tf.distribute.get_strategy(), monitor)
  row = monitor.last
  assert row["flops_per_step"] == _hand_flops(BATCH)
  assert row["all-reduce_bytes"] == 0
  device = tf.DeviceSpec.from_string(
      tf.config.list_logical_devices("CPU")[0].name).to_string()
  assert row["peak_flops_per_sec"] == peak_lib.measured_rate(
      (device,), "float32")
  # Stock MirroredStrategy copies between CPUs without collectives: bytes
  # unknown, not guessed. Token ids in: tokens per second.
  sequence, vocabulary, width = 6, 50, 8

  def embedder():
    model = keras.Sequential([keras.Input((sequence,), dtype="int32"),
                              keras.layers.Embedding(vocabulary, width),
                              keras.layers.Dense(width)])
    model.compile(optimizer="sgd", loss="mse")
    return model
  monitor = tfpar.TrainingMonitor(every=EVERY, peak_flops=PEAK)
  tokens = np.random.RandomState(1).randint(
      0, vocabulary, (BATCH * STEPS, sequence)).astype("int32")
  _fit(stock_strategies.mirrored(
      [d.name for d in tf.config.list_logical_devices("CPU")]), monitor,
       embedder, tokens, np.zeros((len(tokens), sequence, width), "float32"))
  row = monitor.last
  assert row["all-reduce_bytes"] is None and row["all-reduce_busbw"] is None
  assert row["tokens_per_sec"] == pytest.approx(
      BATCH * sequence / row["step_time_s"])
  # Dense on (rows x sequence) x width: forward, weight gradient and
  # input gradient (the embedding's gradient needs it); the lookup is none.
  assert row["flops_per_step"] == 3 * (2 * BATCH * sequence * width * width)


def test_flops_of_einsum_and_convolutions():
  def flops(fn, *shapes):
    graph = tf.function(fn).get_concrete_function(
        *(tf.TensorSpec(s) for s in shapes)).graph
    return step_graph.count_graph(graph).total_flops
  assert flops(lambda a, b: tf.einsum("b...d,de->b...e", a, b),
               (2, 3, 5, 4), (4, 6)) == 2 * (2 * 3 * 5 * 6) * 4

  def conv_and_gradients(x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      total = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME"))
    return tape.gradient(total, [x, w])
  # x 2x5x5x3, w 3x3x3x4: forward output 2x5x5x4, 3 x 3 x 3 per output;
  # the input and the filter gradients cost the same.
  assert flops(conv_and_gradients, (2, 5, 5, 3), (3, 3, 3, 4)) == (
      3 * 2 * (2 * 5 * 5 * 4) * (3 * 3 * 3))


def test_bad_settings_and_the_recipe_switch():
  for kwargs, named in (({"every": 0}, "every=0"),
                        ({"peak_flops": -1}, "peak_flops=-1"),
                        ({"csv_path": 3}, "csv_path=3")):
    with pytest.raises(ValueError, match=named):
      tfpar.TrainingMonitor(**kwargs)
  recipe = schema.validate({"strategy": {"kind": "data_parallel"},
                            "monitor": {"every": 5, "csv_path": "run.csv",
                                        "peak_flops": 1e12}}, "mine")
  monitors = [c for c in recipe_build.make_callbacks(recipe)
              if isinstance(c, tfpar.TrainingMonitor)]
  assert [(m.every, m.csv_path, m.peak_flops) for m in monitors] == [
      (5, "run.csv", 1e12)]
  with pytest.raises(ValueError, match="monitor.every=0"):
    schema.validate({"strategy": {"kind": "data_parallel"},
                     "monitor": {"every": 0}}, "mine")
