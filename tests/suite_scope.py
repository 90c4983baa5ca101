"""What the default test run covers, and what `TFPAR_TEST_FULL=1` adds;
`TFPAR_TEST_SHARE=i/K` runs one share of the costly test files.

The default run keeps CI under its 15-minute budget on 2 cores: where a
matrix of (model, layout, policy, optimizer) combinations would train
every cell, it trains enough cells that every row and every column is met
at least once. `TFPAR_TEST_FULL=1 python -m pytest ...` trains the rest
too, for a change that touches what those cells share.

`TFPAR_TEST_SHARE=i/K` (unset by default) runs every test file that cost
under `LIGHT_CPU_SECONDS` in the last recorded run (`FILE_SECONDS`, the
per-file table a run prints), every file the record does not name, and
the i-th of K shares of the others, balanced by their recorded cost: the
K shares together are the whole suite. Refresh the record from a full
run's output with `grep -E '^ +[0-9.]+ +[0-9.]+ +tests/test_' run.log |
sed 's/^ *//' > tests/file_seconds.txt`.
"""

import os

FULL = os.environ.get("TFPAR_TEST_FULL", "") == "1"
SHARE_ENV = "TFPAR_TEST_SHARE"
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


def parse_share(value):
  """(i, K) of a `TFPAR_TEST_SHARE` value "i/K", 1 <= i <= K.

  Args:
    value: the variable's text.

  Raises:
    ValueError: naming the variable, its value and the rule.
  """
  try:
    share, shares = (int(part) for part in value.split("/"))
  except ValueError:
    share = shares = 0
  if not 1 <= share <= shares:
    raise ValueError(
        f"{SHARE_ENV} must be i/K with whole numbers 1 <= i <= K (the i-th "
        f"of K shares of the costly test files). Received: "
        f"{SHARE_ENV}={value!r}.")
  return share, shares


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
