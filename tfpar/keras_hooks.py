"""The hooks tfpar adds to Keras's TensorFlow trainer.

* Model registration: Keras records the strategy current when a model is
  created (`Model must be created under scope of DistStrat it will be
  trained with`, keras/src/backend/tensorflow/trainer.py) but never tells
  the strategy, and a tensor-parallel strategy cannot otherwise find the
  models it must shard. Models created in scope call
  `strategy.extended.register_model(model)` when it exists.
* Symbolic build: before `fit`, `evaluate` or `predict` builds a model,
  Keras reduces one distributed batch across replicas ("MEAN") only to
  read its shapes and dtypes, which fails on the boolean parts of a
  preprocessor's batch (keras-hub's `padding_mask`) under every
  `tf.distribute` strategy. A model whose strategy's `extended` has
  `symbolic_build_batch` builds from the batch it returns instead
  (`tfpar._compat.keras_trainer.install_symbolic_build_batch`).
* `fit` preparation: `fit` builds the optimizer before any callback runs,
  so a callback that must change the optimizer before it is built
  (`tfpar.ZeRO`) cannot do it from the callback API. `fit` calls
  `callback.prepare_fit(model)` on every callback that has it, first.

* Run checks: `fit`, `evaluate` and `predict` call
  `strategy.extended.check_run(model)` (a setting the strategy cannot
  run, such as `run_eagerly=True` under SPMD tensor parallelism) and
  `strategy.extended.check_batch_size(batch_size)` when the model's
  strategy has them, before any work (a pipeline needs batches that split
  into micro-batches; data replicas need equal shares, `tfpar.batches`).
  Arrays without `batch_size` get Keras's 32; a `tf.data` pipeline is
  checked with its own batch size. `steps_per_execution > 1` is refused
  where the strategy cannot loop over steps
  (`extended.steps_loop_refusal`).
* Input iterators of interrupted runs: when `fit`, `evaluate` or `predict`
  raises after the strategy distributed its input
  (`extended.datasets_distributed` moved; a stock strategy has no such
  counter, so any run that raises under one counts), the input iterator
  sits in the reference cycles of the exception's frames. Python's
  collector would free it wherever it next ran, possibly inside a replica
  thread tracing the next step, and destroying a tf.data iterator can
  wait seconds to minutes on TensorFlow's input threads (measured in
  gdb). The next `fit`, `evaluate` or `predict` collects it first, on the
  calling thread. tfpar's strategies install these hooks, and
  `tfpar.BackupAndRestore` does for stock strategies' resumes.

The optimizer's hooks (gradient accumulation, loss scaling) are in
`tfpar._compat.keras_optimizer_hooks`.

The patches are installed once per process and are idempotent.
"""

import functools
import gc
import inspect


from tfpar import batches
from tfpar._compat import keras_optimizer_hooks
from tfpar._compat import keras_optimizers
from tfpar._compat import keras_trainer
from tfpar._compat.keras_modules import tf_trainer
from tfpar.common import strategy_hooks

_installed = set()


def install_model_registration():
  """Patches `TensorFlowTrainer.__init__` to register models."""
  if "registration" in _installed:
    return
  original = tf_trainer.TensorFlowTrainer.__init__

  @functools.wraps(original)
  def __init__(self, *args, **kwargs):
    original(self, *args, **kwargs)
    strategy = keras_trainer.model_strategy(self)
    strategy_hooks.of(strategy).register_model(self)

  tf_trainer.TensorFlowTrainer.__init__ = __init__
  _installed.add("registration")


def install_optimizer_adoption():
  """Makes every optimizer created in a tfpar strategy's scope ask the
  strategy to prepare it before it is first built
  (`extended.adopt_optimizer`): a custom training loop's optimizer."""
  def adopt(optimizer, variables):
    strategy = keras_optimizers.distribution_strategy(optimizer)
    return strategy_hooks.of(strategy).adopt_optimizer(optimizer, variables)

  keras_optimizer_hooks.install_before_first_build(adopt)


def install_symbolic_build_batch():
  """Patches Keras's symbolic build to ask the model's strategy for the
  batch it builds from (`extended.symbolic_build_batch`), when it has one."""
  if "symbolic_build" in _installed:
    return
  keras_trainer.install_symbolic_build_batch(
      lambda strategy: strategy_hooks.of(strategy).symbolic_build_batch)
  _installed.add("symbolic_build")


def install_fit_preparation():
  """Patches `TensorFlowTrainer.fit` to call `prepare_fit` on callbacks
  before it and `finish_fit` after it however it ends. (`import tfpar`
  also makes `keras.distribution.set_distribution` set tfpar's strategy:
  `keras_distribution.install_set_distribution`.)"""
  if "fit" in _installed:
    return
  original = tf_trainer.TensorFlowTrainer.fit

  @functools.wraps(original)
  def fit(self, *args, callbacks=None, **kwargs):
    check_accumulation_steps(self.optimizer)
    for callback in callbacks or ():
      prepare = getattr(callback, "prepare_fit", None)
      if prepare is not None:
        prepare(self)
    try:
      return original(self, *args, callbacks=callbacks, **kwargs)
    finally:  # Keras skips `on_train_end` when fit raises.
      for callback in callbacks or ():
        finish = getattr(callback, "finish_fit", None)
        if finish is not None:
          finish(self)

  tf_trainer.TensorFlowTrainer.fit = fit
  _installed.add("fit")


def check_accumulation_steps(optimizer):
  """Refuses a `gradient_accumulation_steps` Keras takes but cannot run.

  Keras (3.15) accepts a float such as 2.5 and fails inside TensorFlow at
  the first step (a TypeError, on one device too).

  Args:
    optimizer: the model's optimizer, or None.

  Raises:
    ValueError: the steps are not an integer.

  Example:

  >>> import keras
  >>> check_accumulation_steps(keras.optimizers.Adam(
  ...     gradient_accumulation_steps=2))
  """
  for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
    steps = getattr(candidate, "gradient_accumulation_steps", None)
    if steps is not None and (isinstance(steps, bool) or
                              not isinstance(steps, int)):
      raise ValueError(
          f"gradient_accumulation_steps must be an integer of at least 2 "
          f"(or None for no accumulation). Received: "
          f"gradient_accumulation_steps={steps!r} on optimizer "
          f"{candidate.name!r}.")


_KERAS_DEFAULT_BATCH_SIZE = 32


def install_run_hooks():
  """Patches `fit`, `evaluate`, `predict` to let the strategy check the
  batch size first, and to collect the input iterators of runs that
  raised before the next run."""
  if "run" in _installed:
    return
  for name in ("fit", "evaluate", "predict"):
    _wrap_run(name)
  _installed.add("run")


def _wrap_run(name):
  original = getattr(tf_trainer.TensorFlowTrainer, name)
  signature = inspect.signature(original)

  @functools.wraps(original)
  def method(self, *args, **kwargs):
    _collect_interrupted_runs()
    hooks = strategy_hooks.of(self.distribute_strategy)
    hooks.check_run(self)
    bound = signature.bind_partial(self, *args, **kwargs).arguments
    check_steps_per_execution(self, name, hooks)
    if hooks.checks_batch_size:
      batch_size, what = bound.get("batch_size"), "batch_size"
      if batch_size is None and _is_array_like(bound.get("x")):
        batch_size = _KERAS_DEFAULT_BATCH_SIZE
      if batch_size is None:  # A tf.data pipeline names its own.
        batch_size = batches.dataset_batch_size(bound.get("x"))
        what = "the dataset's batch size"
      hooks.check_batch_size(batch_size, what)
    distributed = hooks.datasets_distributed
    try:
      return original(self, *args, **kwargs)
    except BaseException:
      # A stock strategy (no counter) may have distributed its input too.
      if (hooks.datasets_distributed != distributed or
          distributed is None and
          keras_trainer.model_strategy(self) is not None):
        _collection[0] = True  # Its input iterators await collection.
      raise

  setattr(tf_trainer.TensorFlowTrainer, name, method)


def check_steps_per_execution(model, run, hooks):
  """Refuses `compile(steps_per_execution=N)` with N > 1 for a `run` the
  model's strategy cannot loop over (`hooks.steps_loop_refusal`), before
  any work: TensorFlow would fail inside the traced loop ("You must feed a
  value for placeholder tensor", or a collective's shape mismatch)."""
  steps = getattr(model, "steps_per_execution", 1)
  reason = hooks.steps_loop_refusal() if steps > 1 else None
  if reason:
    raise ValueError(
        f"{type(model.distribute_strategy).__name__} cannot run {run} with "
        f"steps_per_execution > 1: Keras runs the steps inside a tf.cond in "
        f"a tf.while_loop, and {reason}. Received: steps_per_execution="
        f"{steps} on model {model.name!r}; compile with "
        f"steps_per_execution=1 (every layout runs it in one process).")


_collection = [False]  # Whether a run that raised left input iterators.


def _collect_interrupted_runs():
  if _collection[0]:
    _collection[0] = False
    gc.collect()


def _is_array_like(x):
  return hasattr(x, "shape") or (
      isinstance(x, (list, tuple, dict)) and x and all(
          hasattr(v, "shape") for v in (x.values() if isinstance(x, dict)
                                        else x)))
