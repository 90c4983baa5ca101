"""A recipe's [plan] table: its own tensor-parallel rules, honoured by the
tensor-parallel and 3D strategies, and checked when the recipe is read."""

import numpy as np
import pytest

import tfpar
import tfpar.recipes as recipes
from tfpar import memory
from tfpar.common import whole_weights
from recipe_common import example
from recipe_common import fit_losses

# The built-in plan splits every block's MLP pair and replicates the head;
# these rules keep block 0 whole and split the head instead.
_RULES = """
[plan]
rules = [
  ["block0_mlp_(in|out)/.*", "Replicate"],
  ["head/(kernel|bias)", "ColumnParallel"],
]
"""
_TENSOR = """
[strategy]
kind = "tensor_parallel"
[mesh]
data = 2
tensor = 2
"""
_THREE_D = """
[strategy]
kind = "pipeline_parallel"
num_microbatches = 2
[mesh]
data = 1
pipeline = 2
tensor = 2
"""


@pytest.fixture(scope="module")
def one_device_losses():
  return fit_losses()


def _write(tmp_path, text, name="mine"):
  path = tmp_path / f"{name}.toml"
  path.write_text(text)
  return str(path)


def _build(strategy):
  with strategy.scope():
    return example.compile_model(example.token_model())


def _split_styles(model):
  """{variable path: (style, axis)} of the split variables, as built."""
  return {v.path: (v.style.name, v.axis)
          for layout in model._tfpar_layouts  # pylint: disable=W0212
          for v in layout.variables if v.axis is not None}


def _short(device):
  return device.split("device:")[-1]


def _placed_devices(model, tensor):
  """{logical path: the describe table's device cell}, from where the
  variables (and their shards `<path>_shard<k>`) really are. Under SPMD a
  split weight is one variable whose component on each device of a
  tensor group (in device order) is that device's shard."""
  by_path = {v.path: [_short(c.device) for c in memory.components(v)]
             for v in whole_weights.held(model)}  # Shards, not whole.
  split = _split_styles(model)
  cells = {}
  for path, devices in by_path.items():
    logical, _, shard = path.rpartition("_shard")
    if shard.isdigit():
      cells.setdefault(logical, []).append(f"{shard}: " + ",".join(devices))
    elif path in split:
      cells[path] = [f"{k}: " + ",".join(devices[k::tensor])
                     for k in range(tensor)]
    else:
      cells[path] = [",".join(devices)]
  return {path: " | ".join(parts) for path, parts in cells.items()}


def _described_devices(text):
  """{variable path: device cell} of `strategy.describe`'s table."""
  # Then coverage (2 lines), mesh and training.
  rows = text.splitlines()[2:-4]
  return {row.split()[0]: row.split("  ")[-1].strip() for row in rows}


@pytest.mark.parametrize("strategy_table, head_devices", [
    (_TENSOR, "0: CPU:0,CPU:2 | 1: CPU:1,CPU:3"),  # Replicas 0 and 1.
    (_THREE_D, "0: CPU:2 | 1: CPU:3"),  # The last stage's tensor group.
], ids=["tensor", "3d"])
def test_plan_rules_shape_the_split_and_train_like_one_device(
    tmp_path, strategy_table, head_devices, one_device_losses):
  setup = recipes.from_recipe(_write(tmp_path, strategy_table + _RULES))
  assert setup.recipe.plan == {"rules": (
      ("block0_mlp_(in|out)/.*", "Replicate"),
      ("head/(kernel|bias)", "ColumnParallel")), "builtin": True}
  assert setup.recipe.describe().endswith(", plan 2 rule(s)")
  model = _build(setup.strategy)
  assert _split_styles(model) == {
      "block1_mlp_in/kernel": ("ColumnParallel", 1),
      "block1_mlp_in/bias": ("ColumnParallel", 0),
      "block1_mlp_out/kernel": ("RowParallel", 0),
      "head/kernel": ("ColumnParallel", 1),
      "head/bias": ("ColumnParallel", 0)}
  described = _described_devices(setup.strategy.describe(model, None))
  assert described == _placed_devices(
      model, setup.strategy.extended.mesh.shape["tensor"])
  assert described["head/kernel"] == head_devices
  losses = fit_losses(setup.strategy, setup.callbacks)
  np.testing.assert_allclose(losses, one_device_losses, atol=1e-5, rtol=0)


def test_builtin_false_splits_only_what_the_rules_name(tmp_path):
  text = _TENSOR + """
[plan]
builtin = false
rules = [["block1_mlp_in/kernel", "ColumnParallel"],
         ["block1_mlp_out/kernel", "RowParallel"]]
"""
  strategy = recipes.from_recipe(_write(tmp_path, text)).strategy
  assert strategy.plan.rules == (
      ("block1_mlp_in/kernel", tfpar.ColumnParallel()),
      ("block1_mlp_out/kernel", tfpar.RowParallel()))
  assert _split_styles(_build(strategy)) == {  # Block 0's pair stays whole.
      "block1_mlp_in/kernel": ("ColumnParallel", 1),
      "block1_mlp_in/bias": ("ColumnParallel", 0),  # Goes with its kernel.
      "block1_mlp_out/kernel": ("RowParallel", 0)}


@pytest.mark.parametrize("text, message", [
    (_TENSOR + '[plan]\nrules = [["head/kernel", "Column"]]\n',
     r"plan\.rules must be a list of \[regex, style\] pairs with style one "
     r"of \['ColumnParallel', 'RowParallel', 'VocabParallel', 'Replicate'\]"
     r"\. Received: plan\.rules=\[\['head/kernel', 'Column'\]\]"),
    (_TENSOR + '[plan]\nrules = [["head/(kernel", "Replicate"]]\n',
     r"plan\.rules\[0\] must start with a regular expression \(missing \)"),
    (_TENSOR + '[plan]\nrule = []\n',
     r"unknown key 'plan\.rule' in \[plan\]; did you mean 'plan\.rules'\?"),
    (_TENSOR + '[plan]\nbuiltin = "yes"\n',
     r"plan\.builtin must be true or false\. Received: plan\.builtin='yes'"),
    ('[strategy]\nkind = "data_parallel"\n' + _RULES,
     r"\[plan\] is only for kind \['tensor_parallel', 'pipeline_parallel'\], "
     r"and this recipe's strategy\.kind is 'data_parallel'"),
    (_THREE_D.replace("tensor = 2", "tensor = 1") + _RULES,
     r"\[plan\] splits layers over the tensor axis, but mesh\.tensor is 1"),
])
def test_bad_plan_tables_name_the_key(tmp_path, text, message):
  with pytest.raises(ValueError, match=r"Recipe 'mine' \(.*mine\.toml\): "
                     + message):
    recipes.load(_write(tmp_path, text))


def test_a_rule_that_matches_nothing_fails_when_the_model_is_built(tmp_path):
  text = _TENSOR + '[plan]\nrules = [["blok1_mlp_in/kernel", "Replicate"]]\n'
  strategy = recipes.from_recipe(_write(tmp_path, text)).strategy
  with pytest.raises(ValueError, match=r"ShardingPlan rule 0 "
                     r"'blok1_mlp_in/kernel' -> Replicate matches no variable "
                     r"of model 'token_mlp'"):
    _build(strategy)


def test_a_pipeline_mesh_given_without_tensor_refuses_the_plan(tmp_path):
  path = _write(tmp_path, _THREE_D + _RULES)
  with pytest.raises(ValueError, match=r"Recipe 'mine' on the given Mesh\("
                     r"data=2, pipeline=2, tensor=1.*\[plan\] splits layers"):
    recipes.from_recipe(path, mesh=tfpar.Mesh({"data": 2, "pipeline": 2}))
