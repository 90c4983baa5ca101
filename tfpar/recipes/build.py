"""`tfpar.from_recipe`: a recipe's strategy and callbacks."""

import dataclasses
import os

from tfpar import mesh as mesh_lib
from tfpar.data_parallel import DataParallelStrategy
from tfpar.expert_parallel import ExpertParallelStrategy
from tfpar.monitor.callback import TrainingMonitor
from tfpar.pipeline import PipelineParallelStrategy
from tfpar.recipes import files
from tfpar.recipes import rules
from tfpar.recipes import schema
from tfpar.recipes import training
from tfpar.tensor_parallel import ShardingPlan
from tfpar.tensor_parallel import TensorParallelStrategy
from tfpar.tensor_parallel import styles
from tfpar.zero import ZeRO

_STRATEGIES = {
    "data_parallel": DataParallelStrategy,
    "tensor_parallel": TensorParallelStrategy,
    "pipeline_parallel": PipelineParallelStrategy,
    "expert_parallel": ExpertParallelStrategy,
}


@dataclasses.dataclass(frozen=True)
class RecipeSetup:
  """What `tfpar.from_recipe` returns; unpacks as `strategy, callbacks`.

  Attributes:
    strategy: the `tf.distribute.Strategy` to build and compile the model
      under.
    callbacks: the Keras callbacks to pass to `fit` (e.g. `tfpar.ZeRO`), a
      new list on every call: append your own.
    recipe: the `tfpar.recipes.Recipe` they were made from.

  Example:

  >>> import tfpar.recipes
  >>> strategy, callbacks = tfpar.recipes.from_recipe("zero2")
  >>> callbacks
  [<tfpar.zero.callback.ZeRO object at ...>]
  """

  strategy: object
  callbacks: list
  recipe: schema.Recipe

  def __iter__(self):
    return iter((self.strategy, self.callbacks))


def from_recipe(path_or_name=None, mesh=None):
  """The strategy and callbacks of a recipe from `strategies/` or a file.

  A script written once against `from_recipe()` changes parallelism from
  the command line: `tfpar launch --recipe NAME script.py` (the workers
  read the recipe from the `TFPAR_RECIPE` environment variable).

  Args:
    path_or_name: a recipe name (`tfpar.recipes.available()`, e.g.
      `"zero2"`) or the path of a `.toml` recipe. None: the recipe named by
      the `TFPAR_RECIPE` environment variable (set by
      `tfpar launch --recipe`).
    mesh: a `tfpar.Mesh` to use instead of the recipe's `[mesh]`. Default:
      `tfpar.Mesh.from_cluster_resolver(**recipe.mesh)`, so the same recipe
      runs on this host and across `TF_CONFIG` workers.

  A recipe's `[training]` table sets Keras's global dtype policy here
  (`training.precision`), so build the model after this call; its
  `gradient_accumulation_steps` reaches the optimizer through the
  callbacks (`tfpar.recipes.training.RecipeTraining`).

  Returns:
    A `RecipeSetup`: `strategy, callbacks = from_recipe(...)`; its `recipe`
    attribute is the `tfpar.recipes.Recipe`.

  Raises:
    ValueError: no recipe given and `TFPAR_RECIPE` unset, an unknown
      recipe, a recipe that breaks a rule (naming the key), or a `mesh` the
      recipe cannot run on. A `[plan]` rule that matches no variable is
      `tfpar.ShardingPlan`'s ValueError when the model is built.

  Example:

  >>> import keras, numpy as np, tfpar.recipes
  >>> strategy, callbacks = tfpar.recipes.from_recipe("zero2")
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  ...   model.compile(optimizer="adam", loss="mse")
  >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8,
  ...                     callbacks=callbacks, verbose=0)
  """
  if path_or_name is None:
    path_or_name = os.environ.get(files.RECIPE_ENV)
    if not path_or_name:
      raise ValueError(
          f"from_recipe() needs a recipe: a name (one of "
          f"{files.available()}) or a .toml path, or the "
          f"{files.RECIPE_ENV} environment variable that "
          f"`tfpar launch --recipe NAME` sets. Received: "
          f"path_or_name=None and {files.RECIPE_ENV} unset.")
  recipe = files.load(path_or_name)
  if mesh is None:
    mesh = mesh_lib.Mesh.from_cluster_resolver(**recipe.mesh)
    if recipe.kind == "expert_parallel":  # data = -1 is now a size.
      rules.check_combination(recipe, mesh.shape,
                              f"Recipe {recipe.name!r} on {mesh!r}")
  elif isinstance(mesh, mesh_lib.Mesh):
    rules.check_combination(recipe, mesh.shape,
                            f"Recipe {recipe.name!r} on the given {mesh!r}")
  else:
    raise ValueError(f"from_recipe: mesh must be a tfpar.Mesh or None. "
                     f"Received: mesh={mesh!r}")
  training.apply_precision(recipe)
  options = dict(recipe.options)
  if recipe.plan is not None:
    options["plan"] = make_plan(recipe)
  strategy = _STRATEGIES[recipe.kind](mesh, **options)
  return RecipeSetup(strategy, make_callbacks(recipe), recipe)


def make_plan(recipe):
  """The `tfpar.ShardingPlan` of a recipe's `[plan]` table.

  Args:
    recipe: a `tfpar.recipes.Recipe` with a `plan`.

  Returns:
    `tfpar.ShardingPlan([(regex, style), ...], builtin=...)`.

  Example:

  >>> from tfpar.recipes import schema
  >>> recipe = schema.validate({
  ...     "strategy": {"kind": "tensor_parallel"}, "mesh": {"tensor": 2},
  ...     "plan": {"rules": [["head/kernel", "ColumnParallel"]]}})
  >>> make_plan(recipe).rules
  (('head/kernel', ColumnParallel()),)
  """
  plan_rules = [(pattern, getattr(styles, style)())
                for pattern, style in recipe.plan["rules"]]
  return ShardingPlan(plan_rules, builtin=recipe.plan["builtin"])


def make_callbacks(recipe):
  """The Keras callbacks a recipe asks for (a new list).

  Args:
    recipe: a `tfpar.recipes.Recipe`.

  Returns:
    A `RecipeTraining` for a recipe with a `[training]` table, then
    `tfpar.ZeRO(...)` for a recipe with a `[zero]` table, then
    `tfpar.TrainingMonitor(...)` for a recipe with a `[monitor]` table.

  Example:

  >>> from tfpar import recipes
  >>> [c.stage for c in recipes.make_callbacks(recipes.load("zero3"))]
  [3]
  """
  callbacks = []
  if recipe.training:
    callbacks.append(training.RecipeTraining(recipe))
  if recipe.zero is not None:
    callbacks.append(ZeRO(**recipe.zero))
  if recipe.monitor is not None:
    callbacks.append(TrainingMonitor(**recipe.monitor))
  return callbacks
