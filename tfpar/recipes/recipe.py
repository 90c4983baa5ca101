"""A validated recipe (`schema.validate` makes one): what
`tfpar.from_recipe` builds."""

import dataclasses

from tfpar.recipes import plan_table


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A validated recipe: what `tfpar.from_recipe` builds.

  Attributes:
    name: the file's name without `.toml`, e.g. `"zero2"`.
    path: the file it was read from ("" when made from a dict).
    kind: `"data_parallel"`, `"tensor_parallel"`, `"pipeline_parallel"` or
      `"expert_parallel"`.
    mesh: the `[mesh]` axis sizes, e.g. `{"data": -1, "tensor": 2}`.
    options: keyword arguments of the strategy, e.g.
      `{"num_microbatches": 8, "schedule": "1f1b"}` or `{"expert": 2}`.
    zero: keyword arguments of `tfpar.ZeRO` (`stage`, `offload`), or None.
    summary: the recipe's one-line description.
    plan: the `[plan]` table as `{"rules": ((regex, style name), ...),
      "builtin": bool}`, or None for the built-in plans.
    training: the `[training]` table (`precision`: a Keras dtype policy
      name, `gradient_accumulation_steps`), or None.
    monitor: keyword arguments of `tfpar.TrainingMonitor` (`every`,
      `csv_path`, `log_dir`, `peak_flops`), or None.

  Example:

  >>> from tfpar.recipes import schema
  >>> schema.validate({"strategy": {"kind": "data_parallel"},
  ...                  "zero": {"stage": 2}}, name="mine").describe()
  'mine: data_parallel on mesh data=-1, ZeRO stage 2'
  """

  name: str
  path: str
  kind: str
  mesh: dict
  options: dict
  zero: dict = None
  summary: str = ""
  plan: dict = None
  training: dict = None
  monitor: dict = None

  def describe(self):
    """One line: the strategy kind, its options, the mesh, ZeRO and plan.

    Example:

    >>> from tfpar import recipes
    >>> recipes.load("1f1b").describe()
    "1f1b: pipeline_parallel, num_microbatches=8, schedule='1f1b' on mesh data=-1 pipeline=2"
    """
    options = "".join(f", {k}={v!r}" for k, v in self.options.items())
    mesh = " ".join(f"{axis}={size}" for axis, size in self.mesh.items())
    zero = ""
    if self.zero:
      offload = self.zero["offload"]
      zero = f", ZeRO stage {self.zero['stage']}" + (
          f" offload={offload}" if offload else "")
    plan = f", {plan_table.describe(self.plan)}" if self.plan else ""
    training = "".join(f", {k}={v!r}" for k, v in (self.training or
                                                   {}).items())
    monitor = "" if self.monitor is None else (
        f", monitor every {self.monitor.get('every', 10)} steps")
    return (f"{self.name}: {self.kind}{options} on mesh {mesh}{zero}{plan}"
            f"{training}{monitor}")
