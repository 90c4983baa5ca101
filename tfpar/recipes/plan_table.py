"""A recipe's `[plan]` table: its own tensor-parallel sharding rules.

The built-in plans split attention, embeddings and MLP pairs. A recipe for a
model they do not fit names its rules, the TOML form of
`tfpar.ShardingPlan([(regex, style), ...], builtin=...)`:

  [plan]
  rules = [
    ["block0_mlp_(in|out)/.*", "Replicate"],
    ["head/(kernel|bias)", "ColumnParallel"],
  ]
  builtin = true   # built-in plans for the layers no rule touches

Pure Python: checking a recipe does not start TensorFlow.
"""

import re

STYLES = ("ColumnParallel", "RowParallel", "VocabParallel", "Replicate")
KINDS = ("tensor_parallel", "pipeline_parallel")
RULES_RULE = (f"must be a list of [regex, style] pairs with style one of "
              f"{list(STYLES)}")


def is_rule_list(value):
  """Whether `value` has the shape of `plan.rules` (regexes checked later).

  Args:
    value: the parsed `plan.rules` value.

  Example:

  >>> is_rule_list([["head/kernel", "ColumnParallel"]])
  True
  >>> is_rule_list([["head/kernel", "Column"]])
  False
  """
  return isinstance(value, list) and all(
      isinstance(rule, list) and len(rule) == 2
      and isinstance(rule[0], str) and rule[1] in STYLES for rule in value)


def read(where, table):
  """The `[plan]` table as `{"rules": ((regex, style name), ...),
  "builtin": bool}`, with every regex compiled once to check it.

  Args:
    where: the start of error messages, naming the recipe.
    table: the `[plan]` table, its keys already checked by the schema.

  Returns:
    The plan settings; `tfpar.from_recipe` turns them into a
    `tfpar.ShardingPlan`.

  Raises:
    ValueError: a rule whose regex does not compile, naming
      `plan.rules[i]`.

  Example:

  >>> read("Recipe 'x'", {"rules": [["head/kernel", "ColumnParallel"]]})
  {'rules': (('head/kernel', 'ColumnParallel'),), 'builtin': True}
  >>> read("Recipe 'x'", {"rules": [["head/(kernel", "Replicate"]]})
  Traceback (most recent call last):
  ...
  ValueError: Recipe 'x': plan.rules[0] must start with a regular expression (missing ), unterminated subpattern at position 5). Received: plan.rules[0]=['head/(kernel', 'Replicate']
  """
  rules = []
  for index, (pattern, style) in enumerate(table.get("rules", [])):
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(
          f"{where}: plan.rules[{index}] must start with a regular "
          f"expression ({e}). Received: plan.rules[{index}]="
          f"{[pattern, style]!r}") from None
    rules.append((pattern, style))
  return {"rules": tuple(rules), "builtin": table.get("builtin", True)}


def describe(plan):
  """A short phrase for `Recipe.describe`.

  Args:
    plan: what `read` returned.

  Example:

  >>> describe({"rules": (("a", "Replicate"),), "builtin": False})
  'plan 1 rule(s), no built-in plans'
  """
  builtin = "" if plan["builtin"] else ", no built-in plans"
  return f"plan {len(plan['rules'])} rule(s){builtin}"
