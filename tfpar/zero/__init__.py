"""ZeRO: optimizer state, gradients and weights sharded over the replicas.

Names load on first use: the planner reads `estimate` without TensorFlow.
"""

from tfpar import lazy_exports

_EXPORTS = {
    "ZeRO": "tfpar.zero.callback",
    "ZeroEstimate": "tfpar.zero.estimate",
    "estimate_bytes": "tfpar.zero.estimate",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports.lazy_exports(__name__, _EXPORTS)
