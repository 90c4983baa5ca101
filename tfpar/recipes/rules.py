"""The combinations of recipe settings that cannot run.

Checked on a recipe's own `[mesh]` when it is read, and again on the mesh
given to `tfpar.from_recipe`. Pure Python.
"""


def check_combination(recipe, shape, where):
  """Raises a ValueError for a recipe that cannot run on a mesh `shape`.

  Args:
    recipe: a `Recipe`.
    shape: `{axis: size}` (-1 for an inferred size): the recipe's own
      `[mesh]` or the shape of a mesh given to `tfpar.from_recipe`.
    where: the start of the messages, naming the recipe (and the mesh).

  Raises:
    ValueError: the first rule broken, naming the key (`mesh.tensor`,
      `strategy.sequence_parallel`, `zero`, ...), its value and the rule.

  Example:

  >>> from tfpar.recipes import schema
  >>> recipe = schema.validate({"strategy": {"kind": "data_parallel"}}, "dp")
  >>> check_combination(recipe, {"data": 2, "pipeline": 1, "tensor": 2},
  ...                   "Recipe 'dp'")
  Traceback (most recent call last):
  ...
  ValueError: Recipe 'dp': mesh.tensor must be 1 for strategy.kind 'data_parallel' (every device holds the whole model); use kind 'tensor_parallel' to split weights over a tensor axis. Received: mesh.tensor=2
  """
  inferred = [axis for axis, size in shape.items() if size == -1]
  if len(inferred) > 1:
    raise ValueError(
        f"{where}: at most one mesh axis may be -1 (inferred). Received: "
        + ", ".join(f"mesh.{axis}=-1" for axis in inferred))
  kind, options = recipe.kind, recipe.options

  def bad(axis, rule):
    return error(where, f"mesh.{axis}", shape[axis], rule)

  if kind == "data_parallel":
    for axis, instead in (("pipeline", "pipeline_parallel"),
                          ("tensor", "tensor_parallel")):
      if shape[axis] != 1:
        raise bad(axis, f"must be 1 for strategy.kind 'data_parallel' "
                  f"(every device holds the whole model); use kind "
                  f"'{instead}' to split "
                  + ("layers into stages" if axis == "pipeline" else
                     "weights over a tensor axis"))
  if kind == "expert_parallel":
    _check_expert(recipe, shape, where)
  if options.get("sequence_parallel") and shape["tensor"] == 1:
    raise error(where, "strategy.sequence_parallel", True,
                "needs a tensor axis larger than 1 to split the sequence "
                "over, but mesh.tensor is 1")
  if kind == "tensor_parallel":
    if shape["pipeline"] != 1:
      raise bad("pipeline", "must be 1 for strategy.kind 'tensor_parallel'; "
                "for tensor-parallel pipeline stages (3D) use kind "
                "'pipeline_parallel' with a tensor axis")
    if shape["tensor"] == 1:
      raise bad("tensor", "must be more than 1 (or -1) for strategy.kind "
                "'tensor_parallel', which splits weights over the tensor "
                "axis; use kind 'data_parallel' for tensor = 1")
  if kind == "pipeline_parallel" and shape["pipeline"] == 1:
    raise bad("pipeline", "must be more than 1 (or -1) for strategy.kind "
              "'pipeline_parallel', which puts one stage on each pipeline "
              "device; use kind 'data_parallel' for pipeline = 1")
  if recipe.plan is not None and shape["tensor"] == 1:
    raise ValueError(
        f"{where}: [plan] splits layers over the tensor axis, but "
        f"mesh.tensor is 1; give the mesh a tensor axis or drop [plan]. "
        f"Received: mesh.tensor=1 and a [plan] of "
        f"{len(recipe.plan['rules'])} rule(s)")


def _check_expert(recipe, shape, where):
  """An expert-parallel recipe: every device on `data`, and the expert
  size dividing the data size (when known)."""
  for axis in ("pipeline", "tensor"):
    if shape[axis] != 1:
      raise error(where, f"mesh.{axis}", shape[axis],
                  "must be 1 for strategy.kind 'expert_parallel': the expert "
                  "groups are carved out of the data axis, and "
                  "tfpar.ExpertParallelStrategy does not combine with "
                  f"{axis} parallelism yet")
  expert, data = recipe.options["expert"], shape["data"]
  if data != -1 and data % expert:
    fits = [n for n in range(1, data + 1) if data % n == 0]
    raise error(where, "strategy.expert", expert,
                f"must divide mesh.data = {data} (the expert groups are "
                f"carved out of the data replicas), so one of {fits}")


def error(where, key, value, rule):
  """A ValueError naming the key, its value and the rule it breaks.

  Args:
    where: the recipe, e.g. `"Recipe 'zero2'"`.
    key: the dotted key, e.g. `"zero.stage"`.
    value: its value.
    rule: what it must be, e.g. `"must be one of [1, 2, 3]"`.

  Example:

  >>> error("Recipe 'x'", "zero.stage", 4, "must be one of [1, 2, 3]")
  ValueError("Recipe 'x': zero.stage must be one of [1, 2, 3]. Received: zero.stage=4")
  """
  return ValueError(f"{where}: {key} {rule}. Received: {key}={value!r}")
