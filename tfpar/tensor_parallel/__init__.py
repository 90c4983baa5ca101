"""Tensor parallelism: `TensorParallelStrategy`, `ShardingPlan` and styles."""

from tfpar.common.instrument import CommunicationLog
from tfpar.common.split_weights import logical_weights
from tfpar.common.split_weights import ShardedWeight
from tfpar.tensor_parallel.plan import ShardingPlan
from tfpar.tensor_parallel.strategy import TensorParallelStrategy
from tfpar.tensor_parallel.styles import ColumnParallel
from tfpar.tensor_parallel.styles import Replicate
from tfpar.tensor_parallel.styles import RowParallel
from tfpar.tensor_parallel.styles import VocabParallel
