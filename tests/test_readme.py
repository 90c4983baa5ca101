"""README.md's two set-up commands are exactly what CI runs."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
  with open(os.path.join(ROOT, path)) as f:
    return f.read()


def test_readme_has_two_setup_commands_and_ci_runs_them():
  section = _read("README.md").split("## Set up on a fresh machine")[1]
  section = section.split("\n## ")[0]
  commands = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
  assert len(commands) == 2
  install_and_demo, tests = commands
  assert install_and_demo.startswith("pip install") and "\n" not in tests
  ci_lines = _read(".ci/run").splitlines()
  assert install_and_demo in ci_lines
  assert tests in ci_lines
