"""Loading a backup's optimizer state into an optimizer that accumulates
gradients over another number of steps.

A Keras optimizer with `gradient_accumulation_steps` keeps one accumulator
per trainable variable among its variables, right after its step counter
and learning rate (and its moving averages, with `use_ema`), and counts
micro-steps (batches) in its step counter. A backup made at the end of an
accumulation (tfpar's backups on resume-able positions are) holds zero
accumulators, so the state of `k` updates maps exactly onto another
accumulation: drop or add zero accumulators, and count `k` updates in the
new optimizer's micro-steps. Keras itself skips, with a warning only, a
state whose variable count differs.

Only public Keras API here (`optimizer.variables`' names,
`save_own_variables`, `load_own_variables`).
"""

import contextlib

import numpy as np

_COUNTER = "iteration"
_ACCUMULATOR_SUFFIX = "gradient_accumulator"
_BEFORE_BUILD = ("iteration", "learning_rate")  # Made by the constructor.


def accumulation_of(optimizer):
  """The optimizer's gradient accumulation steps (1: none)."""
  return getattr(optimizer, "gradient_accumulation_steps", None) or 1


def _refuse(optimizer, saved_accumulation, why):
  raise ValueError(
      f"Cannot load a backup made with gradient_accumulation_steps "
      f"{saved_accumulation} into optimizer {optimizer.name!r} with "
      f"gradient_accumulation_steps {accumulation_of(optimizer)}: {why}. "
      f"Keep gradient_accumulation_steps={saved_accumulation} and adjust the "
      f"per-replica batch instead (tfpar.keep_global_batch).")


def _check_optimizer(optimizer, saved_accumulation):
  if isinstance(optimizer.get_config().get("learning_rate"), dict):
    _refuse(optimizer, saved_accumulation,
            "its learning-rate schedule counts micro-steps under "
            "accumulation, so it would not follow the backup's schedule")
  names = [v.name for v in optimizer.variables]
  if not names or names[0] != _COUNTER:
    _refuse(optimizer, saved_accumulation,
            f"its first variable is {names[:1]}, not Keras's step counter "
            f"{_COUNTER!r}")
  return names


def _entries(store):
  return [np.asarray(store[str(i)]) for i in range(len(store.keys()))]


def converted_store(optimizer, store, saved_accumulation, current):
  """`store` (a backup's optimizer variables, "0", "1", ...) as `optimizer`
  saves its own: accumulators dropped or added (zeros), the step counter
  in the optimizer's micro-steps.

  Args:
    optimizer: a built Keras optimizer.
    store: the saved entries (a mapping of "0", "1", ... to arrays).
    saved_accumulation: the gradient accumulation steps of the optimizer
      that saved them (1: none).
    current: what `optimizer.save_own_variables` writes now (the whole
      entries it loads, whatever splits them over devices).

  Returns:
    A dict of "0", "1", ... to numpy arrays.

  Raises:
    ValueError: a learning-rate schedule, a step counter in the middle of
      an accumulation, or entries that do not match the optimizer's.

  Example:

  >>> import keras
  >>> saved = keras.optimizers.Adam(gradient_accumulation_steps=2)
  >>> saved.build([keras.Variable([1.0, 2.0])])
  >>> store = {}
  >>> saved.save_own_variables(store)
  >>> store["0"] = np.array(6)  # 3 updates of 2 micro-steps.
  >>> now = keras.optimizers.Adam()
  >>> now.build([keras.Variable([1.0, 2.0])])
  >>> current = {}
  >>> now.save_own_variables(current)
  >>> converted = converted_store(now, store, 2, current)
  >>> len(store), len(converted), int(converted["0"])
  (5, 4, 3)
  """
  names = _check_optimizer(optimizer, saved_accumulation)
  saved, current = _entries(store), _entries(current)
  leading = sum(1 for name in names if name in _BEFORE_BUILD)
  # Accumulators follow the constructor's variables (and the moving
  # averages, as many, with use_ema): Keras's build order.
  now_count = (sum(1 for name in names if name.endswith(_ACCUMULATOR_SUFFIX))
               if accumulation_of(optimizer) > 1 else 0)
  saved_count = len(saved) - (len(current) - now_count)
  if (saved_count > 0) != (saved_accumulation > 1):
    _refuse(optimizer, saved_accumulation,
            f"the backup holds {len(saved)} optimizer variables, which do "
            f"not map onto this optimizer's {len(current)}")
  start = leading + (saved_count if optimizer.use_ema else 0)
  if any(np.any(a) for a in saved[start:start + saved_count]):
    _refuse(optimizer, saved_accumulation,
            "its gradient accumulators are not zero (not saved at the end "
            "of an accumulation)")
  saved = saved[:start] + saved[start + saved_count:]
  start = leading + (now_count if optimizer.use_ema else 0)
  saved = (saved[:start] + [np.zeros_like(a) for a in
                            current[start:start + now_count]] +
           saved[start:])
  for index, (entry, now) in enumerate(zip(saved, current)):
    if entry.shape != now.shape:
      _refuse(optimizer, saved_accumulation,
              f"its optimizer entry {index} has shape {entry.shape} in "
              f"the backup once mapped, {now.shape} here")
  micro_steps = int(saved[0])
  if micro_steps % saved_accumulation:
    _refuse(optimizer, saved_accumulation,
            f"the backup was made after micro-step {micro_steps}, in the "
            f"middle of an accumulation")
  saved[0] = np.asarray(micro_steps // saved_accumulation * accumulation_of(
      optimizer), dtype=saved[0].dtype)
  return {str(i): entry for i, entry in enumerate(saved)}


@contextlib.contextmanager
def loading_across(optimizer, saved_accumulation, current):
  """A context in which `optimizer.load_own_variables` loads a state saved
  with `saved_accumulation` (through `converted_store`); it does nothing
  when the accumulation is the same. Build the optimizer first: the saving
  and loading of split states is set up when it is built.

  Args:
    optimizer: a built Keras optimizer.
    saved_accumulation: the saving optimizer's accumulation steps.
    current: what `optimizer.save_own_variables` writes now.
  """
  if saved_accumulation == accumulation_of(optimizer):
    yield
    return
  _check_optimizer(optimizer, saved_accumulation)
  had_own = "load_own_variables" in vars(optimizer)
  load = optimizer.load_own_variables

  def load_own_variables(store):
    load(converted_store(optimizer, store, saved_accumulation, current))

  object.__setattr__(optimizer, "load_own_variables", load_own_variables)
  try:
    yield
  finally:
    if had_own:
      object.__setattr__(optimizer, "load_own_variables", load)
    else:
      object.__delattr__(optimizer, "load_own_variables")
