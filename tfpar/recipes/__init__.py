"""Recipes: ready-made parallel layouts, one small TOML file each.

`strategies/` holds one recipe per layout (`available()` lists them);
`from_recipe(NAME)` returns its strategy and callbacks, and
`tfpar launch --recipe NAME script.py` runs a script written against
`from_recipe()` under that recipe, with no code change.

Finding and checking recipes (`available`, `find`, `load`, `schema`) is
pure Python; `from_recipe` imports TensorFlow when first used.

Example:

>>> import tfpar.recipes
>>> tfpar.recipes.available()  # doctest: +SKIP
['1f1b', '3d', 'data_parallel', 'gpipe', 'tensor', ...]
>>> strategy, callbacks = tfpar.recipes.from_recipe("zero2")  # doctest: +SKIP
"""

import importlib

from tfpar.recipes.files import RECIPE_ENV
from tfpar.recipes.files import available
from tfpar.recipes.files import directories
from tfpar.recipes.files import find
from tfpar.recipes.files import load
from tfpar.recipes.recipe import Recipe

_BUILD = ("from_recipe", "make_callbacks", "make_plan", "RecipeSetup")
_TRAINING = ("RecipeTraining",)

__all__ = ["RECIPE_ENV", "Recipe", "available", "directories", "find",
           "load", *_BUILD, *_TRAINING]


def __getattr__(name):
  if name in _BUILD:  # Imports TensorFlow, so only when asked for.
    return getattr(importlib.import_module("tfpar.recipes.build"), name)
  if name in _TRAINING:
    return getattr(importlib.import_module("tfpar.recipes.training"), name)
  raise AttributeError(f"module 'tfpar.recipes' has no attribute {name!r}")
