"""Recipes in strategies/: every recipe trains like one device, bad recipes
are errors naming the key, and `tfpar launch --recipe` switches recipe
with no code change."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tfpar
import tfpar.recipes as recipes  # tfpar.from_recipe, once exported.
from tfpar import cli
from tfpar.recipes import schema
from recipe_common import BATCH
from recipe_common import EXAMPLE
from recipe_common import fit_losses
from recipe_common import ROOT
from recipe_common import ROWS
import stock_strategies
import suite_scope

STRATEGIES = os.path.join(ROOT, "strategies")
ISSUE_RECIPES = {"data_parallel", "zero1", "zero2", "zero3", "zero_offload",
                 "tensor", "tensor_sequence_parallel", "gpipe", "1f1b", "3d"}
KIND_CLASSES = {"data_parallel": "DataParallelStrategy",
                "tensor_parallel": "TensorParallelStrategy",
                "pipeline_parallel": "PipelineParallelStrategy",
                "expert_parallel": "ExpertParallelStrategy"}


@pytest.fixture(scope="module")
def one_device_losses():
  return fit_losses()


def _subprocess_env():
  """The workers import this tree's tfpar, whatever is installed."""
  path = os.environ.get("PYTHONPATH")
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
              PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


# --- every recipe, end to end -------------------------------------------------


def test_the_issue_recipes_exist():
  assert ISSUE_RECIPES <= set(recipes.available())
  assert recipes.directories()[0] == STRATEGIES


def _assert_built_as_declared(setup):
  recipe, strategy, callbacks = setup.recipe, setup.strategy, setup.callbacks
  assert type(strategy).__name__ == KIND_CLASSES[recipe.kind]
  shape = strategy.mesh.shape
  for axis, size in recipe.mesh.items():
    assert size == -1 or shape[axis] == size, (axis, shape)
  assert shape["pipeline"] * shape["tensor"] * shape["data"] == 4
  options = recipe.options
  if recipe.kind == "pipeline_parallel":
    assert strategy.num_microbatches == options["num_microbatches"]
    assert strategy.schedule == options.get("schedule", "1f1b")
  if recipe.kind == "tensor_parallel":
    assert strategy.extended._sequence_parallel == options.get(  # pylint: disable=protected-access
        "sequence_parallel", False)
  if recipe.training:
    assert isinstance(callbacks[0], recipes.RecipeTraining)
    callbacks = callbacks[1:]
  if recipe.zero is None:
    assert callbacks == []
  else:
    (zero,) = callbacks
    assert isinstance(zero, tfpar.ZeRO)
    assert (zero.stage, zero.offload) == (recipe.zero["stage"],
                                          recipe.zero["offload"])


def _float32_recipes():
  # Expert recipes need a model with MoE layers: test_expert_plan_recipe.py
  # trains them on keras-hub's Mixtral.
  return [name for name in recipes.available()
          if not recipes.load(name).training
          and recipes.load(name).kind != "expert_parallel"]


# Trained by default: one recipe of each strategy, with the most settings
# (sequence parallelism, 3D with ZeRO-1, ZeRO offload, GPipe). Every
# recipe is built and checked as declared; TFPAR_TEST_FULL=1 trains the
# rest too (their strategies train the same GPT in their own test files).
_TRAINED = ("tensor_sequence_parallel", "3d", "zero_offload", "gpipe")


@pytest.mark.parametrize("name", _float32_recipes())
def test_every_recipe_builds_as_declared(name):
  _assert_built_as_declared(recipes.from_recipe(name))


@pytest.mark.parametrize("name", suite_scope.cases(
    [n for n in _float32_recipes() if n in _TRAINED],
    [n for n in _float32_recipes() if n not in _TRAINED]))
def test_every_recipe_trains_like_one_device(name, one_device_losses):
  setup = recipes.from_recipe(name)
  _assert_built_as_declared(setup)
  strategy, callbacks = setup
  losses = fit_losses(strategy, callbacks)
  print(f"{name}: max |loss - one device| = "
        f"{np.abs(losses - one_device_losses).max():.2e}")
  np.testing.assert_allclose(losses, one_device_losses, atol=1e-5, rtol=0)


def test_a_training_recipe_sets_the_policy_and_the_accumulation():
  """`zero2_bf16_accumulate`: the policy and accumulation reach a script
  that only calls from_recipe(); it trains as one device with the same
  settings, within the spread of stock MirroredStrategy vs one device."""
  import keras  # pylint: disable=g-import-not-at-top
  try:
    setup = recipes.from_recipe("zero2_bf16_accumulate")
    _assert_built_as_declared(setup)
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    strategy, callbacks = setup
    losses = fit_losses(strategy, callbacks)
    training = [c for c in callbacks if isinstance(c, recipes.RecipeTraining)]
    reference = fit_losses(None, [recipes.RecipeTraining(setup.recipe)])
    without = fit_losses(None)  # No accumulation: a different model.
    mirrored = fit_losses(stock_strategies.mirrored(
        tfpar.Mesh().devices))
  finally:
    keras.mixed_precision.set_global_policy("float32")
  assert len(training) == 1
  spread = np.abs(mirrored - without).max()
  difference = np.abs(losses - reference).max()
  print(f"bf16 + accumulation recipe: {difference:.1e}; mirrored spread "
        f"{spread:.1e}; without accumulation "
        f"{np.abs(without - reference).max():.1e}")
  assert difference <= 2 * spread + 1e-5
  assert np.abs(without - reference).max() > 10 * difference


def test_a_training_recipe_refuses_a_model_built_under_another_policy():
  setup = recipes.from_recipe("zero2_bf16_accumulate")
  import keras  # pylint: disable=g-import-not-at-top
  keras.mixed_precision.set_global_policy("float32")
  strategy, callbacks = setup
  with pytest.raises(ValueError, match="training.precision is "
                     "'mixed_bfloat16', but model .* 'float32' policy"):
    fit_losses(strategy, callbacks)


# --- the files ----------------------------------------------------------------


@pytest.mark.parametrize("name", recipes.available())
def test_every_recipe_is_documented_at_its_top(name):
  with open(os.path.join(STRATEGIES, f"{name}.toml")) as f:
    text = f.read()
  head = []
  for line in text.splitlines():
    if not line.startswith("#"):
      break
    head.append(line)
  assert head and head[0].startswith(f"# {name}: "), head[:1]
  comment = "\n".join(head)
  for topic in ("When:", "Memory per device:", "Communication:", "Mesh:"):
    assert topic in comment, (name, topic)
  recipe = recipes.load(name)
  assert recipe.summary
  with open(os.path.join(STRATEGIES, "README.md")) as f:
    assert f"`{name}`" in f.read()


def test_schema_repeats_the_library_constants():
  assert schema.AXES == tfpar.mesh.AXES
  assert schema.SCHEDULES == tfpar.pipeline.schedules.SCHEDULES


# --- bad recipes --------------------------------------------------------------

_DP = '[strategy]\nkind = "data_parallel"\n'
_PP = '[strategy]\nkind = "pipeline_parallel"\nnum_microbatches = 4\n'
_TP = '[strategy]\nkind = "tensor_parallel"\n'


@pytest.mark.parametrize("text, message", [
    ('colour = "blue"\n' + _DP,
     r"unknown key 'colour' in the top level\. .*Received: colour='blue'"),
    (_DP + "[zero]\nstag = 2\n",
     r"unknown key 'zero\.stag' in \[zero\]; did you mean 'zero\.stage'\?"),
    (_DP + "[mesh]\nexpert = 2\n", r"unknown key 'mesh\.expert'"),
    ("[strategy]\nkind = \"fsdp\"\n",
     r"strategy\.kind must be one of .*Received: strategy\.kind='fsdp'"),
    ("[mesh]\ndata = -1\n", r"the \[strategy\] table with strategy\.kind is "
     r"required"),
    ("[strategy]\nsequence_parallel = true\n", r"strategy\.kind is required"),
    (_DP + "num_microbatches = 8\n",
     r"strategy\.num_microbatches is only for kind \['pipeline_parallel'\], "
     r"and this recipe's strategy\.kind is 'data_parallel'"),
    (_TP + "schedule = \"gpipe\"\n[mesh]\ntensor = 2\n",
     r"strategy\.schedule is only for kind"),
    ('[strategy]\nkind = "pipeline_parallel"\n[mesh]\npipeline = 2\n',
     r"strategy\.num_microbatches is required for kind 'pipeline_parallel'"),
    (_PP.replace("4", "0") + "[mesh]\npipeline = 2\n",
     r"strategy\.num_microbatches must be a positive integer\. "
     r"Received: strategy\.num_microbatches=0"),
    (_PP.replace("4", "true") + "[mesh]\npipeline = 2\n",
     r"strategy\.num_microbatches must be a positive integer"),
    (_PP + 'schedule = "zigzag"\n[mesh]\npipeline = 2\n',
     r"strategy\.schedule must be one of \['gpipe', '1f1b', 'interleaved'\]"),
    (_PP + 'recompute = "yes"\n[mesh]\npipeline = 2\n',
     r"strategy\.recompute must be true or false"),
    (_PP + 'stages = "block1"\n[mesh]\npipeline = 2\n',
     r"strategy\.stages must be \"auto\" or a list"),
    (_TP + "sequence_parallel = 1\n[mesh]\ntensor = 2\n",
     r"strategy\.sequence_parallel must be true or false"),
    (_DP + "[mesh]\ndata = 0\n",
     r"mesh\.data must be a positive integer or -1"),
    (_DP + "[mesh]\ndata = 2.5\n", r"mesh\.data must be a positive integer"),
    (_TP + "[mesh]\ndata = -1\ntensor = -1\n",
     r"at most one mesh axis may be -1.*mesh\.data=-1, mesh\.tensor=-1"),
    (_DP + "[zero]\nstage = 4\n",
     r"zero\.stage must be one of \[1, 2, 3\]\. Received: zero\.stage=4"),
    (_DP + "[zero]\noffload = \"cpu\"\n", r"zero\.stage is required"),
    (_DP + "[zero]\nstage = 1\noffload = \"nvme\"\n",
     r"zero\.offload must be one of \['none', 'cpu'\]"),
    ("summary = 3\n" + _DP, r"summary must be a string"),
    ("zero = 2\n" + _DP, r"zero must be a table"),
    # Impossible combinations.
    (_DP + "[mesh]\ndata = 2\ntensor = 2\n",
     r"mesh\.tensor must be 1 for strategy\.kind 'data_parallel'.*"
     r"Received: mesh\.tensor=2"),
    (_DP + "[mesh]\npipeline = 2\n",
     r"mesh\.pipeline must be 1 for strategy\.kind 'data_parallel'"),
    (_TP + "[mesh]\ntensor = 2\npipeline = 2\n",
     r"mesh\.pipeline must be 1 for strategy\.kind 'tensor_parallel'"),
    (_TP + "[mesh]\ndata = -1\n",
     r"mesh\.tensor must be more than 1 .* Received: mesh\.tensor=1"),
    (_PP + "[mesh]\ndata = -1\n",
     r"mesh\.pipeline must be more than 1 .* 'pipeline_parallel'"),
    (_TP + "sequence_parallel = true\n[mesh]\ndata = 2\ntensor = 1\n",
     r"strategy\.sequence_parallel needs a tensor axis larger than 1 to "
     r"split the sequence over, but mesh\.tensor is 1\. "
     r"Received: strategy\.sequence_parallel=True"),
])
def test_bad_recipes_name_the_key(tmp_path, text, message):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(ValueError, match=r"Recipe 'bad' \(.*bad\.toml\): "
                     + message):
    recipes.load(str(path))


def test_invalid_toml_is_an_error_naming_the_file(tmp_path):
  path = tmp_path / "broken.toml"
  path.write_text("[strategy\nkind = 1\n")
  with pytest.raises(ValueError, match=r"Recipe 'broken' \(.*broken\.toml\) "
                     r"is not valid TOML"):
    recipes.load(str(path))


def test_unknown_recipe_lists_the_available_ones():
  with pytest.raises(ValueError, match=r"Unknown recipe 'zero9'\. Did you "
                     r"mean 'zero\d'\? Available recipes: 1f1b, 3d, "
                     r"data_parallel, .*zero_offload"):
    recipes.from_recipe("zero9")
  with pytest.raises(ValueError, match=r"Recipe file 'nowhere/x\.toml' does "
                     r"not exist"):
    recipes.load("nowhere/x.toml")


# --- from_recipe ----------------------------------------------------------------


def test_from_recipe_unpacks_and_reads_the_launch_variable(monkeypatch):
  strategy, callbacks = recipes.from_recipe("zero2")
  assert isinstance(strategy, tfpar.DataParallelStrategy)
  assert [c.stage for c in callbacks] == [2]
  assert recipes.from_recipe("zero2").callbacks is not callbacks
  monkeypatch.setenv(recipes.RECIPE_ENV, recipes.find("zero_offload"))
  setup = recipes.from_recipe()
  assert setup.recipe.name == "zero_offload"
  assert [(c.stage, c.offload) for c in setup.callbacks] == [(2, "cpu")]
  monkeypatch.delenv(recipes.RECIPE_ENV)
  with pytest.raises(ValueError, match=r"from_recipe\(\) needs a recipe.*"
                     r"TFPAR_RECIPE environment variable that `tfpar launch "
                     r"--recipe NAME` sets"):
    recipes.from_recipe()


def test_from_recipe_takes_a_path_and_a_mesh(tmp_path):
  path = tmp_path / "mine.toml"
  path.write_text(_TP + "sequence_parallel = true\n[mesh]\ntensor = -1\n")
  mesh = tfpar.Mesh({"data": 1, "tensor": 4})
  strategy, callbacks = recipes.from_recipe(str(path), mesh=mesh)
  assert isinstance(strategy, tfpar.TensorParallelStrategy)
  assert strategy.mesh == mesh and callbacks == []
  assert recipes.from_recipe(str(path)).strategy.mesh.shape["tensor"] == 4


def test_from_recipe_refuses_a_mesh_the_recipe_cannot_run_on():
  with pytest.raises(ValueError, match=r"Recipe 'data_parallel' on the given "
                     r"Mesh\(data=2, pipeline=1, tensor=2.*mesh\.tensor must "
                     r"be 1"):
    recipes.from_recipe("data_parallel",
                        mesh=tfpar.Mesh({"data": 2, "tensor": 2}))
  with pytest.raises(ValueError, match=r"strategy\.sequence_parallel needs a "
                     r"tensor axis"):
    recipes.from_recipe("tensor_sequence_parallel",
                        mesh=tfpar.Mesh({"data": 4}))
  with pytest.raises(ValueError, match=r"mesh must be a tfpar\.Mesh"):
    recipes.from_recipe("zero1", mesh={"data": 4})


# --- tfpar launch --recipe ------------------------------------------------------


def _launch(*args, timeout=60):
  return subprocess.run(
      [sys.executable, "-m", "tfpar", "launch", *args], capture_output=True,
      text=True, timeout=timeout, env=_subprocess_env(), cwd=ROOT)


def test_launch_refuses_an_unknown_recipe_before_starting_workers(tmp_path):
  marker = tmp_path / "started"
  script = tmp_path / "script.py"
  script.write_text(f"open(r'{marker}', 'w').close()\n")
  run = _launch("--recipe", "zero9", str(script))
  assert run.returncode == 2
  assert ("--recipe 'zero9': Unknown recipe 'zero9'. Did you mean"
          in run.stderr)
  assert "Available recipes: 1f1b, 3d, data_parallel" in run.stderr
  assert not marker.exists()
  bad = tmp_path / "bad.toml"
  bad.write_text(_DP + "[mesh]\ntensor = 2\n")
  run = _launch("--recipe", str(bad), str(script))
  assert run.returncode == 2 and "mesh.tensor must be 1" in run.stderr
  assert not marker.exists()


def test_launch_gives_the_workers_the_recipe(tmp_path):
  script = tmp_path / "script.py"
  script.write_text("import os\nprint(os.environ['TFPAR_RECIPE'])\n")
  run = _launch("--workers", "2", "--recipe", "gpipe", str(script))
  assert run.returncode == 0, run.stdout + run.stderr
  assert sorted(run.stdout.splitlines()) == [
      f"[worker {i}] {os.path.join(STRATEGIES, 'gpipe.toml')}"
      for i in range(2)]
  assert cli.build_parser().parse_args(
      ["launch", "--recipe", "3d", "t.py"]).recipe == "3d"


@pytest.mark.parametrize("name, strategy, mesh, callbacks", [
    ("zero2", "DataParallelStrategy", {"data": 4, "pipeline": 1, "tensor": 1},
     ["ZeRO"]),
    ("tensor", "TensorParallelStrategy",
     {"data": 2, "pipeline": 1, "tensor": 2}, []),
])
def test_launch_switches_recipe_with_no_code_change(
    tmp_path, one_device_losses, name, strategy, mesh, callbacks):
  losses_file = tmp_path / "losses.json"
  run = _launch("--workers", "2", "--devices-per-worker", "2", "--timeout",
                "300", "--recipe", name, EXAMPLE, "--epochs=1",
                f"--examples={ROWS}", f"--batch_size={BATCH}",
                f"--losses_file={losses_file}", timeout=330)
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  assert (f"[worker 0] strategy {strategy}, callbacks {callbacks}"
          in run.stdout)
  with open(losses_file) as f:
    result = json.load(f)
  assert result["recipe"] == name and result["strategy"] == strategy
  assert result["mesh"] == mesh and result["workers"] == 2
  assert result["callbacks"] == callbacks
  np.testing.assert_allclose(result["losses"], one_device_losses, atol=1e-5,
                             rtol=0)
