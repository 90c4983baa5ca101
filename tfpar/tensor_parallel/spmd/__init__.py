"""SPMD tensor parallelism: `TensorParallelStrategy(mesh, spmd=True)`.

Every device of a tensor group runs its own trace of the step; the
Megatron all-reduces are collectives among the group (see
docs/tensor_parallel_spmd.md)."""
