"""ZeRO: optimizer state, gradients and weights sharded over the replicas.

Names load on first use: the planner reads `estimate` without TensorFlow.
"""

import importlib

_EXPORTS = {
    "ZeRO": "tfpar.zero.callback",
    "ZeroEstimate": "tfpar.zero.estimate",
    "estimate_bytes": "tfpar.zero.estimate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'tfpar.zero' has no attribute {name!r}")


def __dir__():
  return __all__
