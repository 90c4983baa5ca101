"""Data parallelism: every replica holds the whole model."""

from tfpar.data_parallel.strategy import DataParallelStrategy
