"""What the default test run covers, and what `TFPAR_TEST_FULL=1` adds;
`TFPAR_TEST_SHARE=i/K` (or `auto/K`) runs one share of the costly test
files.

The default run keeps CI under its 15-minute budget on 2 cores: where a
matrix of (model, layout, policy, optimizer) combinations would train
every cell, it trains enough cells that every row and every column is met
at least once. `TFPAR_TEST_FULL=1 python -m pytest ...` trains the rest
too, for a change that touches what those cells share.

`TFPAR_TEST_SHARE=i/K` (unset by default) runs every test file that cost
under `LIGHT_CPU_SECONDS` in the last recorded run (`FILE_SECONDS`, the
per-file table a run prints), every file the record does not name, and
the i-th of K shares of the others, balanced by their recorded cost: the
K shares together are the whole suite. `TFPAR_TEST_SHARE=auto/K` (README's
test command, which CI runs) takes i from the commit: the number of commits
in HEAD's history, modulo K, plus one, so a commit always runs the same
share and consecutive commits run the others; with no git history to count
(an unpacked archive) it runs the whole suite. Refresh the record from a full
run's output with `grep -E '^ +[0-9.]+ +[0-9.]+ +tests/test_' run.log |
sed 's/^ *//' > tests/file_seconds.txt`.
"""

import os
import subprocess

FULL = os.environ.get("TFPAR_TEST_FULL", "") == "1"
SHARE_ENV = "TFPAR_TEST_SHARE"
AUTO = "auto"
FILE_SECONDS = os.path.join(os.path.dirname(__file__), "file_seconds.txt")
LIGHT_CPU_SECONDS = 20.0


def cases(default, extra):
  """`default`, plus `extra` when the full run was asked for.

  Args:
    default: the combinations every run trains.
    extra: the ones only `TFPAR_TEST_FULL=1` adds.

  Returns:
    A list of combinations.
  """
  return list(default) + (list(extra) if FULL else [])


def parse_share(value, commits=None):
  """(i, K) of a `TFPAR_TEST_SHARE` value: "i/K" with 1 <= i <= K, or
  "auto/K", the share `commits % K + 1`.

  Args:
    value: the variable's text.
    commits: for "auto/K", the number of commits in HEAD's history, or
      None when there is no history to count.

  Returns:
    (i, K), or None for "auto/K" without `commits`: the whole suite.

  Raises:
    ValueError: naming the variable, its value and the rule.

  Example:

  >>> parse_share("2/3"), parse_share("auto/3", commits=7)
  ((2, 3), (2, 3))
  """
  share, _, shares = value.partition("/")
  try:
    shares = int(shares)
    if share != AUTO or shares < 1:
      share = int(share)
    elif commits is None:
      return None
    else:
      share = commits % shares + 1
  except ValueError:
    share = shares = 0
  if not 1 <= share <= shares:
    raise ValueError(
        f"{SHARE_ENV} must be i/K with whole numbers 1 <= i <= K (the i-th "
        f"of K shares of the costly test files), or {AUTO}/K with K >= 1 "
        f"(the share from the commit). Received: {SHARE_ENV}={value!r}.")
  return share, shares


def commit_count(root):
  """The number of commits in HEAD's history of the git checkout at
  `root`, or None when git or the history is not there."""
  try:
    run = subprocess.run(["git", "-C", root, "rev-list", "--count", "HEAD"],
                         capture_output=True, text=True, timeout=60,
                         check=True)
    return int(run.stdout)
  except (OSError, subprocess.SubprocessError, ValueError):
    return None


def read_file_seconds(path=FILE_SECONDS):
  """{test file path: CPU seconds} from lines "wall cpu path"."""
  seconds = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        _, cpu, name = line.split()
        seconds[name] = float(cpu)
  return seconds


def files_outside_share(share, shares, file_seconds):
  """The recorded test files share `share` of `shares` does not run: the
  costly ones (at least `LIGHT_CPU_SECONDS`) dealt, costliest first, to
  the share with the least recorded cost so far, and not dealt to it.

  Args:
    share: i, from 1.
    shares: K.
    file_seconds: `read_file_seconds()`.

  Example:

  >>> sorted(files_outside_share(1, 2, {"a.py": 90.0, "b.py": 60.0,
  ...                                   "c.py": 40.0, "d.py": 1.0}))
  ['b.py', 'c.py']
  """
  costly = sorted((name for name, cpu in file_seconds.items()
                   if cpu >= LIGHT_CPU_SECONDS),
                  key=lambda name: (-file_seconds[name], name))
  loads = [0.0] * shares
  outside = set()
  for name in costly:
    target = loads.index(min(loads))
    loads[target] += file_seconds[name]
    if target != share - 1:
      outside.add(name)
  return outside
