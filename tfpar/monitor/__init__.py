"""`tfpar.TrainingMonitor` and the pieces it reads a training step with.

`csv_log` and `plot` are pure Python (with NumPy), so that
`tfpar monitor plot` starts without TensorFlow; the callback is loaded on
first use.

Example:

>>> import tfpar.monitor
>>> monitor = tfpar.monitor.TrainingMonitor(every=10)  # doctest: +SKIP
"""

import importlib

__all__ = ["TrainingMonitor"]


def __getattr__(name):
  if name == "TrainingMonitor":  # Imports TensorFlow, so only when asked.
    return importlib.import_module("tfpar.monitor.callback").TrainingMonitor
  raise AttributeError(f"module 'tfpar.monitor' has no attribute {name!r}")
