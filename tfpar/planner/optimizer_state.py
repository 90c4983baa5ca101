"""The optimizer as the planner counts it: slots per weight and gradient
accumulation steps."""

import numbers

from tfpar.planner import units


def accumulation_steps(steps, optimizer=None):
  """k, the gradient accumulation steps to plan for, or None for none.

  Args:
    steps: a positive int (1: no accumulation), or None to take the
      `gradient_accumulation_steps` of `optimizer` when it is a Keras
      optimizer.
    optimizer: what `plan` got as its optimizer (or the model's).

  Raises:
    ValueError: `steps` is not a positive integer.

  Example:

  >>> import keras
  >>> from tfpar.planner.optimizer_state import accumulation_steps
  >>> accumulation_steps(4), accumulation_steps(1)
  (4, None)
  >>> accumulation_steps(None, keras.optimizers.SGD(
  ...     gradient_accumulation_steps=2))
  2
  """
  if steps is None:
    # A LossScaleOptimizer (mixed_float16) accumulates in its inner one.
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if not isinstance(steps, numbers.Integral) or isinstance(steps, bool):
      return None  # Not a Keras optimizer, or no accumulation.
  units.check_positive_int(
      steps, "gradient_accumulation_steps",
      "a positive integer (1 for no accumulation)")
  return int(steps) if steps >= 2 else None


def optimizer_slots(optimizer):
  """Optimizer slots per weight: variables the size of the weight.

  Builds a fresh copy of the optimizer on a small variable and counts the
  variables of its shape (gradient accumulators excepted).

  Args:
    optimizer: a Keras optimizer, its name ("adam", "sgd"), an int, or None
      for Adam.

  Raises:
    ValueError: not an optimizer, name or non-negative int.

  Example:

  >>> from tfpar.planner.optimizer_state import optimizer_slots
  >>> optimizer_slots("adam"), optimizer_slots("sgd"), optimizer_slots(3)
  (2, 0, 3)
  """
  if optimizer is None:
    return 2
  if isinstance(optimizer, numbers.Integral) and not isinstance(
      optimizer, bool):
    if optimizer < 0:
      raise ValueError(f"optimizer as a slot count must be >= 0. Received: "
                       f"optimizer={optimizer!r}.")
    return int(optimizer)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  try:
    instance = keras.optimizers.get(optimizer)
    fresh = type(instance).from_config(instance.get_config())
  except Exception as error:  # pylint: disable=broad-except
    raise ValueError(
        f"optimizer must be a Keras optimizer, its name (such as 'adam') or "
        f"a number of slots per weight (pass the number when the optimizer "
        f"cannot be rebuilt from its config). Received: optimizer="
        f"{optimizer!r} ({error}).") from None
  probe = keras.Variable(np.zeros((3, 5), "float32"), name="probe")
  fresh.build([probe])
  return sum(1 for v in fresh.variables
             if tuple(v.shape) == (3, 5) and
             not v.name.endswith("gradient_accumulator"))
