"""The memory planner: bytes per device of every layout, and which to use.

`plan(model, devices, memory_per_device)` estimates, for data parallelism,
the ZeRO stages, CPU offload, tensor and pipeline parallelism (with
recompute) and their combinations, the parameters, gradients, optimizer
state and activations of each layout's fullest device, and recommends the
fastest layout that fits. `estimate_layout(num_parameters, layout)` gives
the model-free formulas (the ZeRO paper's Table 1).

Names load on first use, so `tfpar plan --help` starts without TensorFlow.

Example:

>>> import tfpar.planner
>>> print(tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
...       .recommended.name)
DP64 + ZeRO-1
"""

from tfpar import lazy_exports

_EXPORTS = {
    "Candidate": "tfpar.planner.result",
    "Layout": "tfpar.planner.layout",
    "MemoryEstimate": "tfpar.planner.formulas",
    "PlanResult": "tfpar.planner.result",
    "estimate_layout": "tfpar.planner.api",
    "format_bytes": "tfpar.planner.units",
    "parse_bytes": "tfpar.planner.units",
    "plan": "tfpar.planner.api",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports.lazy_exports(__name__, _EXPORTS)
