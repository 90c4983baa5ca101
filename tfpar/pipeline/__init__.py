"""Pipeline parallelism: `PipelineParallelStrategy`, schedules and traces."""

from tfpar.pipeline.schedules import bubble_fraction
from tfpar.pipeline.schedules import stage_orders
from tfpar.pipeline.strategy import PipelineParallelStrategy
from tfpar.pipeline.callback import PipelineTrace
from tfpar.pipeline.trace import ScheduleTrace
