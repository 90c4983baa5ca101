"""A package's public names loaded on first use (PEP 562 module
`__getattr__`), so that importing the package imports none of its
modules: `tfpar plan --parameters` reads the planner, ZeRO's estimate and
the pipeline's schedules without starting TensorFlow."""

import importlib


def lazy_exports(package, exports):
  """The module `__getattr__` and `__dir__` of `package` for `exports`.

  Args:
    package: the package's name (for the error message).
    exports: {public name: the module that defines it}.

  Example:

  >>> from tfpar.lazy_exports import lazy_exports
  >>> get, names = lazy_exports("tfpar.zero",
  ...                           {"estimate_bytes": "tfpar.zero.estimate"})
  >>> get("estimate_bytes").__name__, names()
  ('estimate_bytes', ['estimate_bytes'])
  """
  public = sorted(exports)

  def __getattr__(name):  # pylint: disable=invalid-name
    if name in exports:
      return getattr(importlib.import_module(exports[name]), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__():  # pylint: disable=invalid-name
    return public

  return __getattr__, __dir__
