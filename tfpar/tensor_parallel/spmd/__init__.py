"""Tensor-parallel layers, weights and checks run once per device of every
tensor group (SPMD; the runtime they run on: `engine/per_device/`).

Every device of a tensor group runs its own trace of the step; the
Megatron all-reduces are collectives among the group (see
docs/tensor_parallel_spmd.md)."""
