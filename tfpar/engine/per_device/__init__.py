"""The per-device (SPMD) runtime shared by tensor, pipeline and expert
parallelism: one trace of the step per device of every tensor group."""
