"""A recipe's `[training]` table: Keras's dtype policy and gradient
accumulation, applied so that a script written once against
`tfpar.from_recipe()` follows the recipe with no change."""

import keras

from tfpar import keras_hooks


def apply_precision(recipe):
  """Sets Keras's global dtype policy to the recipe's `training.precision`
  (`tfpar.from_recipe` calls it before the model is built).

  Args:
    recipe: a `tfpar.recipes.Recipe`.
  """
  precision = (recipe.training or {}).get("precision")
  if precision is not None:
    keras.mixed_precision.set_global_policy(precision)


class RecipeTraining(keras.callbacks.Callback):
  """Checks the model against the recipe's `[training]` table before `fit`
  builds the optimizer, and gives an optimizer without accumulation the
  recipe's `gradient_accumulation_steps`.

  Args:
    recipe: a `tfpar.recipes.Recipe` with a `[training]` table.

  Example:

  >>> from tfpar.recipes import schema
  >>> recipe = schema.validate({"strategy": {"kind": "data_parallel"},
  ...     "training": {"gradient_accumulation_steps": 4}}, "mine")
  >>> RecipeTraining(recipe).steps
  4
  """

  def __init__(self, recipe):
    super().__init__()
    self.recipe = recipe
    self.precision = recipe.training.get("precision")
    self.steps = recipe.training.get("gradient_accumulation_steps")
    keras_hooks.install_fit_preparation()

  def prepare_fit(self, model):
    """Raises a ValueError for a model the recipe does not describe; sets
    the accumulation steps of an unbuilt optimizer that has none."""
    where = f"Recipe {self.recipe.name!r}"
    if self.precision is not None and model.dtype_policy.name != (
        self.precision):
      raise ValueError(
          f"{where}: training.precision is {self.precision!r}, but model "
          f"{model.name!r} was built under the {model.dtype_policy.name!r} "
          f"policy. Build the model after tfpar.from_recipe(), which sets "
          f"Keras's global policy. Received: training.precision="
          f"{self.precision!r}")
    if self.steps is None:
      return
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    current = optimizer.gradient_accumulation_steps
    if current == self.steps:
      return
    if current or optimizer.built:
      raise ValueError(
          f"{where}: training.gradient_accumulation_steps is {self.steps}, "
          f"but the optimizer of {model.name!r} "
          + (f"accumulates over {current} steps" if current else
             "is built already, without accumulation")
          + f". Compile with optimizer(..., gradient_accumulation_steps="
          f"{self.steps}) or leave it unset. Received: training."
          f"gradient_accumulation_steps={self.steps}")
    optimizer.gradient_accumulation_steps = self.steps
