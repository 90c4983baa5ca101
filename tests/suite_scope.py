"""What the default test run covers, and what `TFPAR_TEST_FULL=1` adds.

The default run keeps CI under its 15-minute budget on 2 cores: where a
matrix of (model, layout, policy, optimizer) combinations would train
every cell, it trains enough cells that every row and every column is met
at least once. `TFPAR_TEST_FULL=1 python -m pytest ...` trains the rest
too, for a change that touches what those cells share.
"""

import os

FULL = os.environ.get("TFPAR_TEST_FULL", "") == "1"


def cases(default, extra):
  """`default`, plus `extra` when the full run was asked for.

  Args:
    default: the combinations every run trains.
    extra: the ones only `TFPAR_TEST_FULL=1` adds.

  Returns:
    A list of combinations.
  """
  return list(default) + (list(extra) if FULL else [])

