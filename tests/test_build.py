"""BUILD stays in step with the tree: one py_test per tests/test_*.py."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_text():
  with open(os.path.join(ROOT, "BUILD")) as f:
    return f.read()


def test_every_test_file_has_exactly_one_py_test():
  declared = re.findall(r'py_test\(\s*name = "(\w+)",.*?srcs = \["([^"]+)"\]',
                        _build_text(), flags=re.S)
  on_disk = sorted(os.path.relpath(p, ROOT) for p in
                   glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
  assert sorted(src for _, src in declared) == on_disk
  for name, src in declared:
    assert src == f"tests/{name}.py"


def test_every_file_named_in_build_exists():
  for path in re.findall(r'"((?:tests|examples|tfpar)/[\w/]+\.py)"',
                         _build_text()):
    assert os.path.exists(os.path.join(ROOT, path)), path


def test_package_library_covers_the_package():
  assert 'srcs = glob(["tfpar/**/*.py"])' in _build_text()
  assert os.path.exists(os.path.join(ROOT, "tfpar", "__init__.py"))
