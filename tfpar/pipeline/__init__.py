"""Pipeline parallelism: `PipelineParallelStrategy`, schedules and traces.

Names load on first use: the planner reads `schedules` without TensorFlow.
"""

import importlib

_EXPORTS = {
    "PipelineParallelStrategy": "tfpar.pipeline.strategy",
    "PipelineTrace": "tfpar.pipeline.callback",
    "ScheduleTrace": "tfpar.pipeline.trace",
    "bubble_fraction": "tfpar.pipeline.schedules",
    "stage_orders": "tfpar.pipeline.schedules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'tfpar.pipeline' has no attribute {name!r}")


def __dir__():
  return __all__
