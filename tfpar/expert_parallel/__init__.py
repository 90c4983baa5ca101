"""Expert parallelism: MoE experts split over groups of data replicas."""

from tfpar.expert_parallel.strategy import ExpertParallelStrategy
