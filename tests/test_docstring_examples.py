"""Every example in tfpar's docstrings runs and prints what it shows.

Each module's `>>>` examples run as a doctest, in this process (4 virtual
CPUs, see conftest). An example marked `# doctest: +SKIP` needs what a test
machine does not have (a cluster, a TPU); it is still read by a person.
"""

import doctest
import importlib
import os
import pkgutil

import pytest

import tfpar

_ROOT = tfpar.__path__[0]


def _modules_with_examples():
  names = ["tfpar"] + [info.name for info in pkgutil.walk_packages(
      [_ROOT], prefix="tfpar.") if info.name != "tfpar.__main__"]
  finder = doctest.DocTestFinder()
  return [name for name in sorted(names)
          if any(not example.options.get(doctest.SKIP)
                 for test in finder.find(importlib.import_module(name))
                 for example in test.examples)]


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Examples may write files.
  environment = dict(os.environ)  # Examples may set TF_CONFIG.
  try:
    result = doctest.testmod(
        importlib.import_module(name),
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False, report=True)
  finally:
    os.environ.clear()
    os.environ.update(environment)
  assert result.attempted > 0, f"{name}: no example found"
  assert result.failed == 0, f"{name}: {result.failed} example(s) failed"
