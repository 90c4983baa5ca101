"""Test set-up: 4 virtual CPU devices before TensorFlow starts."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import tfpar  # pylint: disable=g-import-not-at-top

NUM_TEST_DEVICES = 4
tfpar.configure_virtual_cpus(NUM_TEST_DEVICES)


def pytest_terminal_summary(terminalreporter):
  """Seconds per test file, slowest first: where the suite's time goes."""
  seconds = {}
  for reports in terminalreporter.stats.values():
    for report in reports:
      if getattr(report, "when", None) and hasattr(report, "duration"):
        path = report.nodeid.split("::")[0]
        seconds[path] = seconds.get(path, 0.0) + report.duration
  if seconds:
    terminalreporter.write_sep("-", "seconds per test file")
    for path, total in sorted(seconds.items(), key=lambda item: -item[1]):
      terminalreporter.write_line(f"{total:8.1f}  {path}")
