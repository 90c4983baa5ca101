"""`TFPAR_TEST_SHARE=i/K`: K shares that together run every test file once
each costly file, every light or unrecorded file in each share."""

import glob
import os
import subprocess
import sys

import pytest

import suite_scope

_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("shares", [1, 2, 3, 4])
def test_shares_run_each_costly_file_once_and_light_files_always(shares):
  seconds = suite_scope.read_file_seconds()
  costly = {n for n, cpu in seconds.items()
            if cpu >= suite_scope.LIGHT_CPU_SECONDS}
  assert len(costly) > 10
  runs = [set(seconds) - suite_scope.files_outside_share(i, shares, seconds)
          for i in range(1, shares + 1)]
  for name in seconds:
    count = sum(name in run for run in runs)
    assert count == (1 if name in costly else shares), (name, count)
  # Balanced: no share's costly files exceed an even split by more than
  # the costliest file.
  loads = [sum(seconds[n] for n in run & costly) for run in runs]
  total = sum(seconds[n] for n in costly)
  assert max(loads) <= total / shares + max(seconds[n] for n in costly)


def test_the_record_names_test_files_that_exist():
  """A renamed file would run in every share; a stale name is a sign the
  record wants refreshing (suite_scope's docstring says how)."""
  names = {os.path.relpath(p, os.path.dirname(_TESTS))
           for p in glob.glob(os.path.join(_TESTS, "test_*.py"))}
  recorded = set(suite_scope.read_file_seconds())
  assert recorded <= names, sorted(recorded - names)


@pytest.mark.parametrize("value", ["0/2", "3/2", "1/0", "a/b", "2", "1/2/3",
                                   "", "auto/0", "auto/x", "auto", "/2"])
def test_bad_share_is_a_value_error_naming_it(value):
  with pytest.raises(ValueError, match=f"TFPAR_TEST_SHARE must be i/K.*"
                     f"Received: TFPAR_TEST_SHARE='{value}'"):
    suite_scope.parse_share(value, commits=5)


def test_auto_share_follows_the_commit_count():
  """Consecutive commits run consecutive shares, the same commit always the
  same one; with nothing to count, the whole suite."""
  assert [suite_scope.parse_share("auto/3", commits=n) for n in range(7)] == [
      (1, 3), (2, 3), (3, 3), (1, 3), (2, 3), (3, 3), (1, 3)]
  assert suite_scope.parse_share("auto/1", commits=41) == (1, 1)
  assert suite_scope.parse_share("auto/3") is None


def test_commit_count_counts_head_history(tmp_path):
  assert suite_scope.commit_count(str(tmp_path)) is None  # Not a checkout.
  env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
             GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
  for command in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "1"],
                  ["commit", "-q", "--allow-empty", "-m", "2"]):
    subprocess.run(["git", "-C", str(tmp_path)] + command, env=env,
                   check=True, timeout=60)
  assert suite_scope.commit_count(str(tmp_path)) == 2


def _collect(share_value, *files):
  command = [sys.executable, "-m", "pytest", "--collect-only", "-q",
             "-p", "no:xdist"] + list(files)
  env = dict(os.environ, TFPAR_TEST_SHARE=share_value)
  return subprocess.run(command, cwd=os.path.dirname(_TESTS), env=env,
                         capture_output=True, text=True, timeout=300)


def test_pytest_leaves_out_the_other_shares_files():
  """Collected under the share that does not hold test_three_d.py, its
  tests are deselected and test_mesh.py's (light) are kept; a bad value
  stops pytest with the rule."""
  seconds = suite_scope.read_file_seconds()
  share = next(i for i in (1, 2)
               if "tests/test_three_d.py" in
               suite_scope.files_outside_share(i, 2, seconds))
  run = _collect(f"{share}/2", "tests/test_three_d.py", "tests/test_mesh.py")
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "tests/test_mesh.py::" in run.stdout
  assert "tests/test_three_d.py::" not in run.stdout
  assert "deselected" in run.stdout
  run = _collect("3/2", "tests/test_three_d.py", "tests/test_mesh.py")
  assert run.returncode != 0
  assert "TFPAR_TEST_SHARE must be i/K" in run.stdout + run.stderr


def test_pytest_runs_the_commits_share_under_auto():
  """README's `TFPAR_TEST_SHARE=auto/K`: the share of this checkout's
  commit, named in pytest's header."""
  commits = suite_scope.commit_count(os.path.dirname(_TESTS))
  if commits is None:
    pytest.skip("not a git checkout: auto runs the whole suite")
  share = commits % 2 + 1
  outside = suite_scope.files_outside_share(
      share, 2, suite_scope.read_file_seconds())
  run = _collect("auto/2", "tests/test_three_d.py", "tests/test_mesh.py")
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert f"TFPAR_TEST_SHARE=auto/2: share {share} of 2" in run.stdout
  assert "tests/test_mesh.py::" in run.stdout
  assert ("tests/test_three_d.py::" in run.stdout) == (
      "tests/test_three_d.py" not in outside)
