"""Test set-up: 4 virtual CPU devices before TensorFlow starts."""

import gc
import os
import resource
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import suite_scope  # pylint: disable=g-import-not-at-top
import tfpar  # pylint: disable=g-import-not-at-top
from tfpar._compat import custom_gradients  # pylint: disable=g-import-not-at-top

NUM_TEST_DEVICES = 4
_CPU = pytest.StashKey[dict]()
tfpar.configure_virtual_cpus(NUM_TEST_DEVICES)
# As a process does once it has made a tfpar strategy: graphs traced with
# `tf.custom_gradient` (Keras's int8 Dense in the one-device references too)
# are released with their last user, not kept for the whole run.
custom_gradients.hold_custom_gradients_on_their_graphs()


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_SHARE = pytest.StashKey[tuple]()


def pytest_configure(config):
  """Reads `TFPAR_TEST_SHARE` once (`suite_scope.py`): (i, K), or None for
  the whole suite. A bad value stops pytest naming the variable, its value
  and the rule."""
  value = os.environ.get(suite_scope.SHARE_ENV)
  share = None
  if value:
    commits = (suite_scope.commit_count(_ROOT)
               if value.startswith(suite_scope.AUTO) else None)
    try:
      share = suite_scope.parse_share(value, commits)
    except ValueError as error:
      raise pytest.UsageError(str(error)) from error
  config.stash[_SHARE] = share


def pytest_collection_modifyitems(config, items):
  """Under `TFPAR_TEST_SHARE`, leaves out the costly test files of the
  other shares."""
  share = config.stash[_SHARE]
  if share is None:
    return
  outside = suite_scope.files_outside_share(
      *share, suite_scope.read_file_seconds())
  kept, left_out = [], []
  for item in items:
    path = os.path.relpath(str(item.path), _ROOT)
    (left_out if path in outside else kept).append(item)
  if left_out:
    config.hook.pytest_deselected(items=left_out)
    items[:] = kept


def _share_line(config):
  value = os.environ.get(suite_scope.SHARE_ENV)
  if not value:
    return None
  share = config.stash.get(_SHARE, None)
  if share is None:
    return (f"{suite_scope.SHARE_ENV}={value}: no git history to choose a "
            f"share from, so the whole suite")
  return (f"{suite_scope.SHARE_ENV}={value}: share {share[0]} of "
          f"{share[1]} of the costly test files, and every light one "
          f"(without {suite_scope.SHARE_ENV}, the whole suite: "
          f"docs/testing.md)")


def pytest_report_header(config):
  return _share_line(config)


def pytest_collection_finish(session):
  """Once every test file is imported (TensorFlow, Keras, keras-hub and
  the tests' own modules: about 380,000 objects that live as long as the
  process), moves them out of the garbage collector's reach: its full
  passes, about a tenth of a test process's CPU, walked them every time.
  Measured on 3 test files in one process: 5-6% less CPU (docs/testing.md).
  """
  del session
  gc.collect()
  gc.freeze()


def _cpu_seconds():
  """CPU seconds of this process and of its finished child processes (the
  workers a multi-worker test starts)."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  start = _cpu_seconds()
  yield
  item.stash[_CPU] = {"setup": _cpu_seconds() - start}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  start = _cpu_seconds()
  yield
  item.stash.setdefault(_CPU, {})["call"] = _cpu_seconds() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  start = _cpu_seconds()
  yield
  module = getattr(item, "module", None)
  if module is not None and getattr(nextitem, "module", None) is not module:
    _clear_module_caches(module)
  item.stash.setdefault(_CPU, {})["teardown"] = _cpu_seconds() - start


def _clear_module_caches(module):
  """Empties the `functools` caches a finished test file defined: they hold
  its trained models (and their traced steps) for the rest of the worker
  process otherwise, and every later garbage collection walks them."""
  for value in list(vars(module).values()):
    if (callable(getattr(value, "cache_clear", None)) and
        getattr(value, "__module__", None) == module.__name__):
      value.cache_clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  seconds = item.stash.get(_CPU, {}).get(call.when)
  if seconds is not None:  # Carried to the xdist controller with the report.
    outcome.get_result().user_properties.append(("cpu_seconds", seconds))


def pytest_terminal_summary(terminalreporter):
  """Wall and CPU seconds per test file, slowest first: where the suite's
  time goes. The CPU seconds add up to what the suite costs whatever runs
  beside it: on CI's 2 cores the run takes at least their sum / 2."""
  wall, cpu = {}, {}
  for reports in terminalreporter.stats.values():
    for report in reports:
      if getattr(report, "when", None) and hasattr(report, "duration"):
        path = report.nodeid.split("::")[0]
        wall[path] = wall.get(path, 0.0) + report.duration
        cpu[path] = cpu.get(path, 0.0) + sum(
            value for name, value in getattr(report, "user_properties", ())
            if name == "cpu_seconds")
  if wall:
    terminalreporter.write_sep("-", "wall and CPU seconds per test file")
    for path, total in sorted(wall.items(), key=lambda item: -item[1]):
      terminalreporter.write_line(f"{total:8.1f} {cpu[path]:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(wall.values()):8.1f} "
                                f"{sum(cpu.values()):8.1f}  total")
  share_line = _share_line(terminalreporter.config)
  if share_line:
    terminalreporter.write_line(share_line)
