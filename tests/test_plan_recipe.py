"""`tfpar plan` writes its recommendation as a recipe: the file is a valid
recipe, builds the layout the planner sized, and trains like one device."""

import argparse

import numpy as np
import pytest

import tfpar
import tfpar.recipes as recipes
from tfpar.planner import cli
from tfpar.planner import Layout
from tfpar.planner import to_recipe
from recipe_common import BATCH
from recipe_common import example
from recipe_common import fit_losses


def _load(tmp_path, layout):
  path = tmp_path / "planned.toml"
  path.write_text(to_recipe.recipe_text(layout, "A test."))
  return str(path)


@pytest.mark.parametrize("layout, kind, options", [
    (Layout(data=4), "DataParallelStrategy", {}),
    (Layout(data=4, zero=2, offload="cpu"), "DataParallelStrategy", {}),
    (Layout(data=2, tensor=2, zero=1), "TensorParallelStrategy", {}),
    (Layout(data=1, pipeline=4, recompute=True, schedule="gpipe"),
     "PipelineParallelStrategy", {"num_microbatches": 16, "schedule": "gpipe",
                                  "recompute": True}),
    (Layout(data=1, tensor=2, pipeline=2, zero=3, num_microbatches=2),
     "PipelineParallelStrategy", {"num_microbatches": 2, "schedule": "1f1b",
                                  "recompute": False}),
], ids=lambda value: getattr(value, "name", None))
def test_a_layout_becomes_the_recipe_of_that_layout(tmp_path, layout, kind,
                                                     options):
  strategy, callbacks = recipes.from_recipe(_load(tmp_path, layout))
  assert type(strategy).__name__ == kind
  assert strategy.mesh.shape == {"data": layout.data,
                                 "pipeline": layout.pipeline,
                                 "tensor": layout.tensor}
  for option, value in options.items():
    assert getattr(strategy.extended, option) == value, option
  zero = [(c.stage, c.offload) for c in callbacks]
  assert zero == ([(layout.zero, layout.offload)] if layout.zero else [])


def test_the_recipe_text_names_the_layout():
  text = to_recipe.recipe_text(Layout(data=2, pipeline=2), "Line 1\nLine 2")
  assert text.splitlines()[:3] == [
      "# Line 1", "# Line 2", 'summary = "DP2 x PP2 (from tfpar plan)"']


@pytest.mark.parametrize("memory, expected", [
    ("60KB", "DP4 + ZeRO-3"), ("40KB", "DP1 x TP2 x PP2")])
def test_the_recommended_recipe_trains_like_one_device(tmp_path, memory,
                                                       expected):
  model = example.compile_model(example.token_model())
  result = tfpar.plan_layout(model, 4, memory, batch_size=BATCH)
  assert result.recommended.name == expected
  path = result.write_recipe(str(tmp_path / "planned.toml"))
  text = open(path).read()
  assert text.startswith("# Written by tfpar plan: Memory per device for "
                         "'token_mlp' on 4 devices")
  assert f"tfpar launch --recipe {path} train.py" in text
  setup = recipes.from_recipe(path)
  assert setup.recipe.summary == f"{expected} (from tfpar plan)"
  losses = fit_losses(setup.strategy, setup.callbacks)
  np.testing.assert_allclose(losses, fit_losses(), atol=1e-5, rtol=0)


def _plan_cli(*args):
  parser = argparse.ArgumentParser(prog="tfpar")
  cli.add_parser(parser.add_subparsers(dest="command"))
  return cli.run(parser.parse_args(["plan", *args]))


def test_cli_writes_the_recommendation(tmp_path, capsys):
  path = str(tmp_path / "out.toml")
  assert _plan_cli("--parameters", "7.5e9", "--devices", "64",
                   "--memory-per-device", "32GB", "--precision", "mixed",
                   "--write-recipe", path) == 0
  assert f"Wrote the recommended layout to {path}" in capsys.readouterr().out
  recipe = recipes.load(path)
  assert (recipe.kind, recipe.mesh, recipe.zero) == (
      "data_parallel", {"data": 64}, {"stage": 1, "offload": None})


def test_nothing_that_fits_writes_no_recipe(tmp_path):
  path = tmp_path / "out.toml"
  assert _plan_cli("--parameters", "7.5e9", "--devices", "8",
                   "--memory-per-device", "1GB", "--write-recipe",
                   str(path)) == 1
  assert not path.exists()
  result = tfpar.plan_layout(7.5e9, 8, "1GB")
  with pytest.raises(ValueError, match=r"No layout of '7.5B parameters' fits "
                     r"1 GB per device, so there is no recommendation"):
    result.write_recipe(str(path))
