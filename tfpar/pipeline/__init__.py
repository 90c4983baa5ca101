"""Pipeline parallelism: `PipelineParallelStrategy`, schedules and traces.

Names load on first use: the planner reads `schedules` without TensorFlow.
"""

from tfpar import lazy_exports

_EXPORTS = {
    "PipelineParallelStrategy": "tfpar.pipeline.strategy",
    "PipelineTrace": "tfpar.pipeline.callback",
    "ScheduleTrace": "tfpar.pipeline.trace",
    "bubble_fraction": "tfpar.pipeline.schedules",
    "stage_orders": "tfpar.pipeline.schedules",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports.lazy_exports(__name__, _EXPORTS)
