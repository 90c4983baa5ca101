"""Pieces the benchmark scripts share: common flags, a step timer, ratios.

The scripts run as `python benchmarks/<name>.py`, which puts this directory
first on `sys.path`, so they import this module as `common`. Nothing here
imports TensorFlow or Keras at import time: a script must be able to
configure virtual CPUs before TensorFlow starts.
"""

import json
import statistics
import sys
import time


def add_common_flags(parser, runs, steps, skip_steps=5):
  """Adds `--runs`, `--steps`, `--skip-steps`, `--seed` and `--output`.

  Args:
    parser: an `argparse.ArgumentParser`.
    runs: default of `--runs`.
    steps: default of `--steps`.
    skip_steps: default of `--skip-steps`.
  """
  parser.add_argument("--runs", type=int, default=runs,
                      help=f"measured runs per configuration (default {runs})")
  parser.add_argument("--steps", type=int, default=steps,
                      help=f"training steps per run (default {steps})")
  parser.add_argument("--skip-steps", type=int, default=skip_steps,
                      help="steps at the start of each run left untimed "
                      f"(default {skip_steps})")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--output", help="also write the results as JSON here")


def add_global_batch_flag(parser, default, unit="samples"):
  """Adds `--global-batch`: the batch of one step over all replicas."""
  parser.add_argument("--global-batch", type=int, default=default,
                      help=f"{unit} per step (default {default})")


def add_gpt_flags(parser):
  """The shape of the small GPT the tensor-parallel and precision
  benchmarks train: --sequence, --width, --heads, --blocks, --vocab."""
  parser.add_argument("--sequence", type=int, default=64)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--blocks", type=int, default=2)
  parser.add_argument("--vocab", type=int, default=96)


def parse_checked(parser, argv=None, batch_multiple=None):
  """`parser.parse_args(argv)`, refusing `--steps <= --skip-steps`, and a
  `--global-batch` that is not a multiple of `batch_multiple`."""
  args = parser.parse_args(argv)
  if args.steps <= args.skip_steps:
    parser.error("--steps must be larger than --skip-steps")
  if args.runs < 1:
    parser.error("--runs must be at least 1")
  if batch_multiple and args.global_batch % batch_multiple:
    parser.error(f"--global-batch must be a multiple of {batch_multiple}")
  return args


class StepTimer:
  """Keras callback holder: wall time from the start of batch `skip` to the
  end of the epoch, when Keras has fetched the results of every step.

  Use one timer per `model.fit(..., epochs=1)`.

  Example:

    timer = StepTimer(skip=5)
    model.fit(x, y, epochs=1, steps_per_epoch=100,
              callbacks=[timer.callback])
    seconds_per_step = timer.step_time(100)
  """

  def __init__(self, skip):
    import keras  # pylint: disable=g-import-not-at-top
    outer = self

    class _Callback(keras.callbacks.Callback):

      def on_train_batch_begin(self, batch, logs=None):
        if batch == outer.skip:
          outer.start = time.perf_counter()

      def on_epoch_end(self, epoch, logs=None):
        # `logs` are numbers here: every step of the epoch has finished.
        outer.end = time.perf_counter()

    self.skip = skip
    self.start = self.end = None
    self.callback = _Callback()

  @property
  def seconds(self):
    """Wall time of the timed steps."""
    return self.end - self.start

  def step_time(self, steps):
    """Seconds per timed step of an epoch of `steps` steps."""
    return self.seconds / (steps - self.skip)


def alternating(names, run):
  """`names` in order on even runs and reversed on odd ones, so neither
  configuration always goes first."""
  names = list(names)
  return names if run % 2 == 0 else names[::-1]


def alternating_times(names, runs, time_once):
  """{name: [seconds per step of each run]} over `runs` runs, each run
  timing every name once in `alternating` order; prints each measurement
  to stderr as it comes.

  Args:
    names: the configurations (any iterable of names, e.g. a dict).
    runs: how many runs.
    time_once: `time_once(name)` -> seconds per step of one timed fit.
  """
  times = {name: [] for name in names}
  for run in range(runs):
    for name in alternating(times, run):
      times[name].append(time_once(name))
      print(f"run {run + 1}/{runs} {name}: {times[name][-1] * 1e3:.2f} "
            f"ms/step", file=sys.stderr)
  return times


def ratios(numerator, denominator):
  """(ratio of the medians, median of the per-run ratios) of two equally
  long lists of measurements taken in alternating runs."""
  of_medians = statistics.median(numerator) / statistics.median(denominator)
  per_run = statistics.median(a / b for a, b in zip(numerator, denominator))
  return of_medians, per_run


def write_json(path, result):
  """Writes `result` to `path` when a path is given."""
  if path:
    with open(path, "w") as f:
      json.dump(result, f, indent=2)


def data_parallel_and_mirrored(devices):
  """{name: strategy} of `tfpar.DataParallelStrategy` and stock
  `tf.distribute.MirroredStrategy` on the same `devices` (every local
  device, as `tfpar.configure_virtual_cpus` returns them): benchmarks 1
  and 15."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfpar  # pylint: disable=g-import-not-at-top
  return {
      "tfpar.DataParallelStrategy":
          tfpar.DataParallelStrategy(tfpar.Mesh({"data": len(devices)})),
      "tf.distribute.MirroredStrategy":
          tf.distribute.MirroredStrategy(devices=list(devices)),
  }


def synthetic_classification(args, num_samples):
  """Features and labels of a linear 10-way (`args.classes`) problem drawn
  from `args.seed`: the data of the MLP benchmarks."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed)
  x = rng.standard_normal((num_samples, args.features)).astype("float32")
  w = rng.standard_normal((args.features, args.classes)).astype("float32")
  y = (x @ w).argmax(axis=1).astype("int32")
  return x, y


def build_mlp(strategy, args, **optimizer_options):
  """The MLP benchmarks 1 and 2 train, compiled under `strategy`, with Adam
  and `optimizer_options` (e.g. `gradient_accumulation_steps`)."""
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(args.seed)
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((args.features,)),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(args.classes),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3, **optimizer_options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model
