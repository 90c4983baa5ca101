"""ZeRO: optimizer state sharded over the data-parallel replicas."""

from tfpar.zero.callback import ZeRO
