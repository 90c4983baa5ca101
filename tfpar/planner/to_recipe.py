"""A planner layout as a recipe file, so `tfpar launch --recipe FILE` runs
what `tfpar plan` recommends."""

try:
  import tomllib
except ImportError:  # Python 3.10.
  import tomli as tomllib

from tfpar.planner import candidates as candidates_lib
from tfpar.recipes import schema


def recipe_text(layout, comment="", precision="fp32",
                gradient_accumulation_steps=None):
  """The TOML recipe that runs `layout` with tfpar.

  The mesh sizes are the layout's own (not -1): the recipe runs on the
  device count it was planned for, and `tfpar.from_recipe` names the mesh
  axis when the devices differ.

  Args:
    layout: a `tfpar.planner.Layout`.
    comment: text for the file's top comment (one line per line).
    precision: the plan's precision; a Keras policy (`"mixed_float16"`,
      `"mixed_bfloat16"`) goes into the recipe's `[training]` table.
    gradient_accumulation_steps: k >= 2 goes into `[training]` too (None
      or 1: no accumulation).

  Returns:
    The recipe as a string; `tfpar.recipes.load` accepts it.

  Raises:
    ValueError: a layout tfpar cannot run.

  Example:

  >>> from tfpar.planner import Layout
  >>> print(recipe_text(Layout(data=2, tensor=2, zero=1), "From tfpar plan."))
  # From tfpar plan.
  summary = "DP2 x TP2 + ZeRO-1 (from tfpar plan)"
  <BLANKLINE>
  [strategy]
  kind = "tensor_parallel"
  <BLANKLINE>
  [mesh]
  data = 2
  tensor = 2
  <BLANKLINE>
  [zero]
  stage = 1
  <BLANKLINE>
  >>> print(recipe_text(Layout(data=8, expert=4)))
  summary = "DP8 + EP4 (from tfpar plan)"
  <BLANKLINE>
  [strategy]
  kind = "expert_parallel"
  expert = 4
  <BLANKLINE>
  [mesh]
  data = 8
  <BLANKLINE>
  """
  runs, why = candidates_lib.supported(layout)
  if not runs:
    raise ValueError(f"tfpar cannot run {layout.name} yet: {why}.")
  lines = [f"# {line}".rstrip() for line in comment.splitlines()]
  lines += [f'summary = "{layout.name} (from tfpar plan)"', "", "[strategy]"]
  if layout.pipeline > 1:
    lines += ['kind = "pipeline_parallel"',
              f"num_microbatches = {layout.microbatches}",
              f'schedule = "{layout.schedule}"']
    if layout.recompute:
      lines.append("recompute = true")
  elif layout.tensor > 1:
    lines.append('kind = "tensor_parallel"')
  elif layout.expert > 1:
    lines += ['kind = "expert_parallel"', f"expert = {layout.expert}"]
  else:
    lines.append('kind = "data_parallel"')
  lines += ["", "[mesh]", f"data = {layout.data}"]
  lines += [f"{axis} = {size}" for axis, size in (
      ("pipeline", layout.pipeline), ("tensor", layout.tensor)) if size > 1]
  if layout.zero:
    lines += ["", "[zero]", f"stage = {layout.zero}"]
    if layout.offload:
      lines.append(f'offload = "{layout.offload}"')
  training = []
  if precision in schema.PRECISIONS and precision != "float32":
    training.append(f'precision = "{precision}"')
  if gradient_accumulation_steps and gradient_accumulation_steps > 1:
    training.append(
        f"gradient_accumulation_steps = {int(gradient_accumulation_steps)}")
  if training:
    lines += ["", "[training]"] + training
  text = "\n".join(lines) + "\n"
  schema.validate(tomllib.loads(text), name=layout.name)  # Our own check.
  return text
