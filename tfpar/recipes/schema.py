"""What a recipe may say: its keys and their values (`rules` checks the
combinations that cannot run).

A recipe is a TOML table:

  summary = "ZeRO-2: optimizer state and gradients split over data replicas"

  [strategy]           # which tfpar strategy, and its options
  kind = "data_parallel"   # or "expert_parallel" with expert = 2, ...

  [mesh]               # axis sizes for tfpar.Mesh.from_cluster_resolver
  data = -1

  [zero]               # optional: the tfpar.ZeRO callback
  stage = 2

  [plan]               # optional: tensor-parallel rules (`plan_table`)
  rules = [["head/kernel", "ColumnParallel"]]

  [training]           # optional: Keras's precision and accumulation
  precision = "mixed_bfloat16"
  gradient_accumulation_steps = 4

  [monitor]            # optional: the tfpar.TrainingMonitor callback
  every = 50
  csv_path = "run.csv"

Every problem is a `ValueError` that names the key, its value and the rule.
Pure Python: `tfpar launch` checks recipes without importing TensorFlow.
"""

import dataclasses
import difflib

from tfpar.recipes import plan_table
from tfpar.recipes import rules
from tfpar.recipes.recipe import Recipe

KINDS = ("data_parallel", "tensor_parallel", "pipeline_parallel",
         "expert_parallel")
# The same as tfpar.mesh.AXES and tfpar.pipeline.schedules.SCHEDULES (a test
# checks), repeated here so that checking a recipe does not start TensorFlow.
AXES = ("data", "pipeline", "tensor")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_STAGES = (1, 2, 3)
OFFLOADS = ("none", "cpu")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
_PIPELINE = ("pipeline_parallel",)
_TENSOR = ("tensor_parallel",)
_EXPERT = ("expert_parallel",)
# ZeRO, Keras's mixed policies and gradient accumulation are untested with
# tfpar.ExpertParallelStrategy (docs/expert_parallel.md).
_DENSE = ("data_parallel", "tensor_parallel", "pipeline_parallel")


@dataclasses.dataclass(frozen=True)
class _Key:
  rule: str
  check: object
  kinds: tuple = KINDS
  required: tuple = ()


def _bool(value):
  return isinstance(value, bool)


def _positive_int(value):
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _axis_size(value):
  return _positive_int(value) or (value == -1 and not isinstance(value, bool))


def _one_of(values):
  return lambda value: not isinstance(value, bool) and value in values


def _accumulation_steps(value):
  return _positive_int(value) and value >= 2


def _positive_number(value):
  return (isinstance(value, (int, float)) and not isinstance(value, bool) and
          value > 0)


def _path(value):
  return isinstance(value, str) and bool(value)


def _stages(value):
  return value == "auto" or (isinstance(value, list) and all(
      isinstance(name, str) for name in value))


_SECTIONS = {
    "strategy": {
        "kind": _Key(f"must be one of {list(KINDS)}", _one_of(KINDS),
                     required=KINDS),
        "num_microbatches": _Key("must be a positive integer", _positive_int,
                                 _PIPELINE, required=_PIPELINE),
        "schedule": _Key(f"must be one of {list(SCHEDULES)}",
                         _one_of(SCHEDULES), _PIPELINE),
        "stages": _Key("must be \"auto\" or a list of the layer names that "
                       "start stages 1 .. v p-1", _stages, _PIPELINE),
        "virtual_stages": _Key("must be a positive integer (stages per "
                               "pipeline device, at least 2 with schedule "
                               "\"interleaved\")", _positive_int,
                               _PIPELINE),
        "recompute": _Key("must be true or false", _bool, _PIPELINE),
        "sequence_parallel": _Key("must be true or false", _bool, _TENSOR),
        "expert": _Key("must be a positive integer (the data replicas each "
                       "MoE layer's experts are split over)", _positive_int,
                       _EXPERT, required=_EXPERT),
        "capacity_factor": _Key("must be a positive number (leave it out to "
                                "drop no token)", _positive_number, _EXPERT),
    },
    "mesh": {axis: _Key("must be a positive integer or -1 (inferred from "
                        "the device count)", _axis_size) for axis in AXES},
    "zero": {
        "stage": _Key(f"must be one of {list(ZERO_STAGES)}",
                      _one_of(ZERO_STAGES), required=KINDS),
        "offload": _Key(f"must be one of {list(OFFLOADS)}",
                        _one_of(OFFLOADS)),
    },
    "plan": {
        "rules": _Key(plan_table.RULES_RULE, plan_table.is_rule_list,
                      plan_table.KINDS),
        "builtin": _Key("must be true or false", _bool, plan_table.KINDS),
    },
    "training": {
        "precision": _Key(f"must be one of {list(PRECISIONS)} (a Keras "
                          f"dtype policy)", _one_of(PRECISIONS)),
        "gradient_accumulation_steps": _Key(
            "must be an integer of at least 2 (leave it out for no "
            "accumulation)", _accumulation_steps),
    },
    "monitor": {
        "every": _Key("must be a positive integer (steps between reports)",
                      _positive_int),
        "csv_path": _Key("must be a non-empty path string", _path),
        "log_dir": _Key("must be a non-empty path string", _path),
        "peak_flops": _Key("must be a positive number (FLOP/s of one "
                           "device)", _positive_number),
    },
}
# Optional section: the kinds it is for.
_OPTIONAL = {"zero": _DENSE, "plan": plan_table.KINDS, "training": KINDS,
             "monitor": KINDS}
_TOP = ("summary",) + tuple(_SECTIONS)


def keys():
  """Every key a recipe may have, dotted (`"strategy.kind"`, ...).

  Example:

  >>> keys()[:8]
  ['summary', 'strategy', 'mesh', 'zero', 'plan', 'training', 'monitor', 'strategy.kind']
  """
  return list(_TOP) + [f"{section}.{key}" for section, table in
                       _SECTIONS.items() for key in table]


def validate(raw, name="recipe", path=""):
  """Checks a parsed recipe and returns it as a `Recipe`.

  Args:
    raw: the recipe as a dict (what `tomllib` returns).
    name: the recipe's name, for messages and `Recipe.name`.
    path: the file it came from, for messages and `Recipe.path`.

  Returns:
    A `Recipe`.

  Raises:
    ValueError: an unknown key, a missing or wrong value, or an impossible
      combination; the message names the key, its value and the rule.

  Example:

  >>> validate({"strategy": {"kind": "pipeline_parallel",
  ...                        "num_microbatches": 8},
  ...           "mesh": {"data": -1, "pipeline": 2}}).options
  {'num_microbatches': 8}
  >>> validate({"strategy": {"kind": "data_parallel", "schedule": "gpipe"}})
  Traceback (most recent call last):
  ...
  ValueError: Recipe 'recipe': strategy.schedule is only for kind ['pipeline_parallel'], and this recipe's strategy.kind is 'data_parallel'. Received: strategy.schedule='gpipe'
  """
  where = f"Recipe {name!r}" + (f" ({path})" if path else "")
  if not isinstance(raw, dict):
    raise ValueError(f"{where}: a recipe must be a table of keys. "
                     f"Received: {raw!r}")
  for key, value in raw.items():
    if key not in _TOP:
      raise _unknown(where, key, value, _TOP, "the top level")
  summary = raw.get("summary", "")
  if not isinstance(summary, str):
    raise rules.error(where, "summary", summary, "must be a string")
  tables = {}
  for section in _SECTIONS:
    table = raw.get(section, {})
    if not isinstance(table, dict):
      raise rules.error(where, section, table,
                        f"must be a table ([{section}])")
    tables[section] = table
  if "strategy" not in raw:
    raise ValueError(f"{where}: the [strategy] table with strategy.kind is "
                     f"required. Received: no [strategy] table.")
  kind = tables["strategy"].get("kind")
  _check_kind(where, tables["strategy"])
  for section, table in tables.items():
    if section in _OPTIONAL and section not in raw:
      continue
    if kind not in _OPTIONAL.get(section, KINDS):
      raise rules.error(where, f"[{section}]", table,
                        f"is only for kind {list(_OPTIONAL[section])}, and "
                        f"this recipe's strategy.kind is {kind!r}")
    _check_table(where, section, table, kind)
  mesh = dict(tables["mesh"]) or {"data": -1}
  options = {k: v for k, v in tables["strategy"].items() if k != "kind"}
  zero = None
  if "zero" in raw:
    offload = tables["zero"].get("offload", "none")
    zero = {"stage": tables["zero"]["stage"],
            "offload": None if offload == "none" else offload}
  plan = plan_table.read(where, tables["plan"]) if "plan" in raw else None
  training = dict(tables["training"]) if "training" in raw else None
  monitor = dict(tables["monitor"]) if "monitor" in raw else None
  recipe = Recipe(name, path, kind, mesh, options, zero, summary, plan,
                  training, monitor)
  rules.check_combination(recipe, mesh_shape(mesh), where)
  return recipe


def mesh_shape(axis_sizes):
  """`{axis: size}` for every axis, with `tfpar.Mesh`'s defaults: a missing
  axis is 1, except `data`, which is -1 (inferred) when no size is -1.

  Args:
    axis_sizes: a recipe's `[mesh]` table, e.g. `{"pipeline": 2}`.

  Example:

  >>> mesh_shape({"pipeline": 2})
  {'data': -1, 'pipeline': 2, 'tensor': 1}
  """
  shape = {axis: axis_sizes.get(axis, 1) for axis in AXES}
  if "data" not in axis_sizes and -1 not in shape.values():
    shape["data"] = -1
  return shape


def _check_kind(where, strategy):
  spec = _SECTIONS["strategy"]["kind"]
  if "kind" not in strategy:
    raise ValueError(f"{where}: strategy.kind is required; it {spec.rule}. "
                     f"Received: no strategy.kind")
  if not spec.check(strategy["kind"]):
    raise rules.error(where, "strategy.kind", strategy["kind"], spec.rule)


def _check_table(where, section, table, kind):
  allowed = _SECTIONS[section]
  for key, value in table.items():
    dotted = f"{section}.{key}"
    if key not in allowed:
      raise _unknown(where, dotted, value,
                     [f"{section}.{k}" for k in allowed], f"[{section}]")
    spec = allowed[key]
    if not spec.check(value):
      raise rules.error(where, dotted, value, spec.rule)
    if kind not in spec.kinds:
      raise rules.error(where, dotted, value,
                   f"is only for kind {list(spec.kinds)}, and this recipe's "
                   f"strategy.kind is {kind!r}")
  for key, spec in allowed.items():
    if key not in table and kind in spec.required:
      kind_text = "" if spec.required == KINDS else f" for kind {kind!r}"
      raise ValueError(f"{where}: {section}.{key} is required{kind_text}; "
                       f"it {spec.rule}. Received: no {section}.{key}")


def _unknown(where, key, value, allowed, place):
  close = difflib.get_close_matches(key, allowed, n=1)
  hint = f"; did you mean {close[0]!r}?" if close else "."
  return ValueError(
      f"{where}: unknown key {key!r} in {place}{hint} The keys allowed "
      f"there are: {', '.join(allowed)}. Received: {key}={value!r}")
