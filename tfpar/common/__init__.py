"""What several parallelisms share (no parallelism imports another's
internals): `instrument` (communication logs), `split_weights` (weights
held in pieces, seen and saved whole), `whole_weights` (Keras's
`weights`, get/set_weights and count_params in whole weights), `clipping`
(norms of whole weights), `recomputed_state` (a recomputed call's
state updates made once, its added losses differentiable)."""
