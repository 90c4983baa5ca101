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


# The files that cost the most (CPU seconds of a fresh-clone run, largest
# first). Under `-n 3 --dist loadfile` xdist hands out files in collection
# order, two to a worker and then one as each finishes; run alphabetically,
# the 3D and ZeRO files started last and the run ended on one busy worker.
# Starting the largest first (conftest.py) lets the small ones fill in.
LARGEST_FIRST = (
    "test_precision_matrix.py",
    "test_three_d.py",
    "test_multi_worker.py",
    "test_zero.py",
    "test_recipes.py",
    "test_pipeline_real_models.py",
    "test_keras_hub.py",
    "test_gradient_accumulation.py",
    "test_tensor_spmd.py",
    "test_tensor_parallel_sequence.py",
    "test_hangs.py",
    "test_keras_hub_precision.py",
    "test_expert_parallel.py",
    "test_weights_created_in_place.py",
    "test_pipeline.py",
    "test_zero_buckets.py",
    "test_tensor_spmd_multi_worker.py",
)


def file_rank(path):
  """Where a test file goes in the run: the largest first, then the rest
  in their usual order.

  Args:
    path: the test file's path.

  Returns:
    Its index in `LARGEST_FIRST`, or the length of it.
  """
  name = os.path.basename(str(path))
  if name in LARGEST_FIRST:
    return LARGEST_FIRST.index(name)
  return len(LARGEST_FIRST)
