"""ZeRO: optimizer state, gradients and weights sharded over the replicas."""

from tfpar.zero.callback import ZeRO
from tfpar.zero.estimate import estimate_bytes
from tfpar.zero.estimate import ZeroEstimate
