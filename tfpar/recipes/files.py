"""Finding recipes by name or path, and reading them.

Recipes by name are the `NAME.toml` files of the recipe directories, first
match wins:

1. `strategies/` next to the `tfpar` package (a source tree, or an
   editable install);
2. `<sys.prefix>/share/tfpar/strategies` (where a regular install puts
   them).

Anything else is given by path. Pure Python: `tfpar launch` finds and
checks a recipe without importing TensorFlow.
"""

import difflib
import os
import sys

try:
  import tomllib
except ImportError:  # Python 3.10.
  try:
    import tomli as tomllib
  except ImportError:
    tomllib = None

from tfpar.environment import RECIPE_ENV  # pylint: disable=unused-import
from tfpar.recipes import schema

_SUFFIX = ".toml"


def directories():
  """The directories searched for recipes by name, in order (those that
  exist).

  Example:

  >>> from tfpar import recipes
  >>> recipes.directories()  # doctest: +SKIP
  ['/src/tfpar/strategies']
  """
  package_parent = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  candidates = [os.path.join(package_parent, "strategies"),
                os.path.join(sys.prefix, "share", "tfpar", "strategies")]
  found = []
  for path in candidates:
    if os.path.isdir(path) and path not in found:
      found.append(path)
  return found


def available():
  """The names of the recipes found by name, sorted.

  Returns:
    A list like `["1f1b", "3d", "data_parallel", ...]`.

  Example:

  >>> from tfpar import recipes
  >>> "zero2" in recipes.available()
  True
  """
  names = set()
  for directory in directories():
    names.update(entry[:-len(_SUFFIX)] for entry in os.listdir(directory)
                 if entry.endswith(_SUFFIX))
  return sorted(names)


def find(path_or_name):
  """The absolute path of a recipe given by name or by path.

  Args:
    path_or_name: a recipe name (`"zero2"`), or the path of a `.toml` file
      (anything with a `/` or ending in `.toml`).

  Returns:
    The recipe file's absolute path.

  Raises:
    ValueError: no such recipe; the message lists the available ones.

  Example:

  >>> from tfpar import recipes
  >>> recipes.find("zero2")  # doctest: +SKIP
  '/src/tfpar/strategies/zero2.toml'
  """
  if not isinstance(path_or_name, str) or not path_or_name:
    raise ValueError(f"A recipe is a name (one of {available()}) or the "
                     f"path of a .toml file. Received: {path_or_name!r}")
  if os.sep in path_or_name or "/" in path_or_name or path_or_name.endswith(
      _SUFFIX):
    if not os.path.isfile(path_or_name):
      raise ValueError(f"Recipe file {path_or_name!r} does not exist. "
                       f"Recipes by name: {', '.join(available())}.")
    return os.path.abspath(path_or_name)
  for directory in directories():
    path = os.path.join(directory, path_or_name + _SUFFIX)
    if os.path.isfile(path):
      return path
  names = available()
  close = difflib.get_close_matches(path_or_name, names, n=1)
  hint = f" Did you mean {close[0]!r}?" if close else ""
  where = ", ".join(directories()) or "no recipe directory found"
  raise ValueError(
      f"Unknown recipe {path_or_name!r}.{hint} Available recipes: "
      f"{', '.join(names) or 'none'} (in {where}); or give the path of a "
      f".toml file.")


def load(path_or_name):
  """Reads and checks a recipe.

  Args:
    path_or_name: a recipe name (see `available()`) or a `.toml` path.

  Returns:
    A `tfpar.recipes.Recipe`.

  Raises:
    ValueError: no such recipe, a file that is not valid TOML, or a recipe
      that breaks a rule of `tfpar.recipes.schema` (the message names the
      key).

  Example:

  >>> from tfpar import recipes
  >>> recipes.load("zero2").zero
  {'stage': 2, 'offload': None}
  """
  path = find(path_or_name)
  name = os.path.basename(path)
  name = name[:-len(_SUFFIX)] if name.endswith(_SUFFIX) else name
  if tomllib is None:
    raise ValueError("Reading recipes needs Python 3.11's tomllib or the "
                     "tomli package on Python 3.10 (pip install tomli).")
  try:
    with open(path, "rb") as f:
      raw = tomllib.load(f)
  except tomllib.TOMLDecodeError as e:
    raise ValueError(
        f"Recipe {name!r} ({path}) is not valid TOML: {e}") from None
  return schema.validate(raw, name=name, path=path)
