"""Tensor parallelism: `TensorParallelStrategy`, `ShardingPlan` and styles."""

from tfpar.tensor_parallel.instrument import CommunicationLog
from tfpar.tensor_parallel.plan import ShardingPlan
from tfpar.tensor_parallel.strategy import TensorParallelStrategy
from tfpar.tensor_parallel.styles import ColumnParallel
from tfpar.tensor_parallel.styles import Replicate
from tfpar.tensor_parallel.styles import RowParallel
from tfpar.tensor_parallel.styles import VocabParallel
from tfpar.tensor_parallel.variables import logical_weights
from tfpar.tensor_parallel.variables import ShardedWeight
