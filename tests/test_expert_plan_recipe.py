"""Expert parallelism in recipes and in `tfpar plan`.

The `expert` recipe trains keras-hub's Mixtral as one device does; bad
expert recipes are ValueErrors naming the key; the planner's bytes per
device of an expert layout agree with the per-device variables of a model
built under it; and the planner offers, recommends and writes expert
layouts for MoE models, never for dense ones.
"""

import argparse
import gc

import keras
import numpy as np
import pytest

import hub_common
import tfpar
from tfpar.common import whole_weights
import tfpar.recipes as recipes
from test_expert_parallel import expert_bytes_by_device
from test_expert_parallel import language_model
from test_expert_parallel import max_weight_difference
from test_expert_parallel import train
from tfpar import planner
from tfpar.planner import cli as planner_cli
from tfpar.planner import experts as planner_experts
from tfpar.planner import Layout
from variable_accounting import VariableAccounting

DEVICES = 4
PLAN_BATCH = 8


def small_mixtral():
  """The tests' Mixtral (2 MoE layers of 4 experts), compiled with SGD and
  momentum; `tfpar plan --model test_expert_plan_recipe:small_mixtral`."""
  model = language_model("mixtral")
  model.compile(optimizer=hub_common.optimizer("sgd"), loss=keras.losses.
                SparseCategoricalCrossentropy(from_logits=True))
  return model


@pytest.fixture(scope="module")
def recipe_run():
  """One device, then the shipped `expert` recipe, 10 SGD steps each."""
  reference = train("mixtral", "sgd")
  setup = recipes.from_recipe("expert")
  return reference, setup, train("mixtral", "sgd", setup.strategy)


def test_the_expert_recipe_trains_mixtral_like_one_device(recipe_run):
  (reference, reference_losses), setup, (model, losses) = recipe_run
  strategy = setup.strategy
  assert isinstance(strategy, tfpar.ExpertParallelStrategy)
  assert (strategy.expert, strategy.capacity_factor) == (2, None)
  assert strategy.mesh.shape == {"data": DEVICES, "pipeline": 1, "tensor": 1}
  assert setup.callbacks == []
  assert setup.recipe.describe() == (
      "expert: expert_parallel, expert=2 on mesh data=-1")
  np.testing.assert_allclose(losses, reference_losses, atol=1e-5, rtol=0)
  difference = max_weight_difference(model, reference)
  print(f"\nexpert recipe: losses within "
        f"{np.abs(losses - reference_losses).max():.1e}, weights within "
        f"{difference:.1e} of one device")
  assert difference < 1e-5
  # Nothing dropped: every token of every step routed top_k = 2 times.
  assert all(dropped == 0 for dropped, _ in strategy.routing_report().values())


def test_the_estimate_is_the_bytes_on_every_device(recipe_run):
  (reference, _), _, (model, _) = recipe_run
  estimate = planner.estimate_layout(reference, Layout(data=DEVICES,
                                                       expert=2))
  parameters = expert_bytes_by_device(whole_weights.held(model))
  optimizer = expert_bytes_by_device(model.optimizer.variables)
  print(f"\nDP4 + EP2, Mixtral, SGD with momentum: parameters estimated "
        f"{estimate.parameters:,}, measured {sorted(set(parameters.values()))}"
        f"; optimizer estimated {estimate.optimizer:,}, measured "
        f"{sorted(set(optimizer.values()))}")
  assert len(parameters) == DEVICES
  assert set(parameters.values()) == {estimate.parameters}
  # Plus the optimizer's step counter (int64) and learning rate (float32).
  assert set(optimizer.values()) == {estimate.optimizer + 12}
  # Data parallelism's estimate would be the whole experts: 98,304 more.
  whole = planner.estimate_layout(reference, Layout(data=DEVICES))
  assert whole.parameters - estimate.parameters == 196_608 // 2


@pytest.fixture(scope="module")
def build_accounting():
  """Live variable bytes per device while a Mixtral is built and compiled
  under expert 2, and after."""
  accounting = VariableAccounting()
  strategy = tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": DEVICES}),
                                          expert=2)
  with accounting.counting():
    with strategy.scope():
      model = small_mixtral()
    gc.collect()
  return accounting, model


def test_the_build_column_bounds_the_measured_build_peak(build_accounting):
  accounting, model = build_accounting
  assert getattr(model, "_tfpar_experts_split", False)
  reference = language_model("mixtral")
  result = planner.plan(reference, DEVICES, "1GB", batch_size=PLAN_BATCH,
                        node_size=1)
  build = {c.name: c.build_peak for c in result.candidates}["DP4 + EP2"]
  largest = 4 * max(int(np.prod(v.shape)) for v in reference.weights
                    if "/experts/" in v.path)
  peaks = {accounting.peak[f"CPU:{i}"] for i in range(DEVICES)}
  print(f"\nDP4 + EP2 build: estimated {build:,}, measured peak {peaks}")
  # The strategy's own counters (routing, drops: a few dozen bytes) are
  # not model weights.
  assert all(peak - 64 <= build <= peak + largest for peak in peaks)


def test_after_the_build_a_device_keeps_only_its_own_experts(
    build_accounting):
  accounting, _ = build_accounting
  reference = language_model("mixtral")
  estimate = planner.estimate_layout(reference, Layout(data=DEVICES,
                                                       expert=2))
  for i in range(DEVICES):
    # Model weights, plus the two MoE layers' drop counters (8 bytes each).
    assert accounting.live[f"CPU:{i}"] <= estimate.parameters + 64


_EXPERT = '[strategy]\nkind = "expert_parallel"\n'


@pytest.mark.parametrize("text, message", [
    ('[strategy]\nkind = "expert_parallel"\n',
     r"strategy\.expert is required for kind 'expert_parallel'; it must be "
     r"a positive integer"),
    (_EXPERT + "expert = 0\n", r"strategy\.expert must be a positive "
     r"integer .*Received: strategy\.expert=0"),
    (_EXPERT + "expert = 2.0\n", r"strategy\.expert must be a positive "
     r"integer .*Received: strategy\.expert=2\.0"),
    (_EXPERT + "expert = true\n", r"strategy\.expert must be a positive "
     r"integer .*Received: strategy\.expert=True"),
    (_EXPERT + "expert = 2\ncapacity_factor = 0\n",
     r"strategy\.capacity_factor must be a positive number \(leave it out "
     r"to drop no token\)\. Received: strategy\.capacity_factor=0"),
    (_EXPERT + 'expert = 2\ncapacity_factor = "1.25"\n',
     r"strategy\.capacity_factor must be a positive number .*Received: "
     r"strategy\.capacity_factor='1\.25'"),
    (_EXPERT + "expert = 3\n[mesh]\ndata = 4\n",
     r"strategy\.expert must divide mesh\.data = 4 .* one of \[1, 2, 4\]\. "
     r"Received: strategy\.expert=3"),
    (_EXPERT + "expert = 2\n[mesh]\ndata = 2\ntensor = 2\n",
     r"mesh\.tensor must be 1 for strategy\.kind 'expert_parallel'"),
    (_EXPERT + "expert = 2\n[mesh]\ndata = 2\npipeline = 2\n",
     r"mesh\.pipeline must be 1 for strategy\.kind 'expert_parallel'"),
    (_EXPERT + "expert = 2\n[zero]\nstage = 1\n",
     r"\[zero\] is only for kind \['data_parallel', 'tensor_parallel', "
     r"'pipeline_parallel'\], and this recipe's strategy\.kind is "
     r"'expert_parallel'"),
    ('[strategy]\nkind = "data_parallel"\nexpert = 2\n',
     r"strategy\.expert is only for kind \['expert_parallel'\], and this "
     r"recipe's strategy\.kind is 'data_parallel'"),
    ('[strategy]\nkind = "data_parallel"\ncapacity_factor = 1.0\n',
     r"strategy\.capacity_factor is only for kind \['expert_parallel'\]"),
])
def test_bad_expert_recipes_name_the_key(tmp_path, text, message):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(ValueError, match=r"Recipe 'bad' \(.*bad\.toml\): "
                     + message):
    recipes.load(str(path))


def test_the_devices_found_are_checked_before_the_strategy_is_made(
    tmp_path):
  path = tmp_path / "three.toml"
  path.write_text(_EXPERT + "expert = 3\n[mesh]\ndata = -1\n")
  with pytest.raises(ValueError, match=r"Recipe 'three' on Mesh\(data=4.*"
                     r"strategy\.expert must divide mesh\.data = 4"):
    recipes.from_recipe(str(path))
  with pytest.raises(ValueError, match=r"Recipe 'expert' on the given "
                     r"Mesh\(data=2, pipeline=1, tensor=2.*mesh\.tensor must "
                     r"be 1 for strategy\.kind 'expert_parallel'"):
    recipes.from_recipe("expert", mesh=tfpar.Mesh({"data": 2, "tensor": 2}))
  path.write_text(_EXPERT + "expert = 4\ncapacity_factor = 1.25\n")
  strategy = recipes.from_recipe(str(path)).strategy
  assert (strategy.expert, strategy.capacity_factor) == (4, 1.25)


def _just_below_data_parallelism(model, **kwargs):
  """A plan whose memory per device is 1 byte short of what DP4 needs."""
  needs = planner.estimate_layout(model, Layout(data=DEVICES),
                                  batch_size=PLAN_BATCH).total
  return planner.plan(model, DEVICES, needs - 1, batch_size=PLAN_BATCH,
                      **kwargs)


@pytest.fixture(scope="module")
def moe_model():
  return small_mixtral()


def test_moe_models_get_expert_parallelism_and_dense_ones_do_not(
    moe_model):
  moe = _just_below_data_parallelism(moe_model)
  assert [c.name for c in moe.candidates][:4] == [
      "DP4", "DP4 + EP2", "DP4 + EP4", "DP4 + ZeRO-1"]
  assert moe.recommended.name == "DP4 + EP2"
  assert "sparse (MoE) model: Expert + Data Parallelism" in moe.reason
  assert ("tfpar.ExpertParallelStrategy(tfpar.Mesh({\"data\": 4}), "
          "expert=2)" in moe.reason)
  assert any("2 MoE layers with 4 experts each" in n for n in moe.notes)
  dense = _just_below_data_parallelism(hub_common.language_model("mistral"))
  assert not any(c.layout.expert > 1 for c in dense.candidates)
  assert dense.recommended.name == "DP4 + ZeRO-1"
  assert "Memory limited -> ZeRO" in dense.reason
  # A MoE model that fits data parallelism keeps it (the decision guide's
  # first question). node_size=1: no tensor candidates, a faster plan.
  fits = planner.plan(moe_model, DEVICES, "1GB", batch_size=PLAN_BATCH,
                      node_size=1)
  assert fits.recommended.name == "DP4"


def test_expert_layouts_with_policies_and_accumulation(moe_model, tmp_path):
  # Offered under every policy and with accumulation (measured equal:
  # test_expert_parallel_precision).
  for kwargs in (dict(precision="mixed_float16"),
                 dict(precision="mixed_bfloat16"),
                 dict(gradient_accumulation_steps=2)):
    result = planner.plan(moe_model, DEVICES, "1GB", batch_size=PLAN_BATCH,
                          node_size=1, **kwargs)
    assert any(c.layout.expert > 1 for c in result.candidates), kwargs
  # An expert recipe takes the [training] table.
  path = tmp_path / "expert_bf16.toml"
  path.write_text(_EXPERT + 'expert = 2\n[training]\nprecision = '
                  '"mixed_bfloat16"\ngradient_accumulation_steps = 2\n')
  try:
    setup = recipes.from_recipe(str(path))
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
  finally:
    keras.mixed_precision.set_global_policy("float32")
  assert isinstance(setup.strategy, tfpar.ExpertParallelStrategy)
  assert [c.steps for c in setup.callbacks] == [2]
  with pytest.raises(ValueError, match=r"expert=2 needs a model with "
                     r"mixture-of-experts layers"):
    planner.estimate_layout(7.5e9, Layout(data=4, expert=2))
  with pytest.raises(ValueError, match=r"expert must divide data"):
    Layout(data=4, expert=3)
  with pytest.raises(ValueError, match=r"expert parallelism runs over the "
                     r"data axis alone"):
    Layout(data=4, expert=2, zero=1)
  assert planner_experts.expert_sizes(6, planner_experts.MoeFacts(
      (4, 8), 1, 0, 1)) == [2]


def test_tfpar_plan_writes_the_expert_recipe(tmp_path, capsys, moe_model):
  limit = planner.estimate_layout(moe_model, Layout(data=DEVICES),
                                  batch_size=PLAN_BATCH).total - 1
  path = str(tmp_path / "planned.toml")
  parser = argparse.ArgumentParser(prog="tfpar")
  planner_cli.add_parser(parser.add_subparsers(dest="command"))
  code = planner_cli.run(parser.parse_args([
      "plan", "--model", "test_expert_plan_recipe:small_mixtral",
      "--devices", str(DEVICES), "--memory-per-device", str(limit),
      "--batch-size", str(PLAN_BATCH), "--write-recipe", path]))
  assert code == 0
  out = capsys.readouterr().out
  assert "* DP4 + EP2" in out and f"Wrote the recommended layout to {path}" \
      in out
  recipe = recipes.load(path)
  assert (recipe.kind, recipe.options, recipe.mesh) == (
      "expert_parallel", {"expert": 2}, {"data": DEVICES})
  strategy = recipes.from_recipe(path).strategy
  assert isinstance(strategy, tfpar.ExpertParallelStrategy)
  assert strategy.expert == 2
