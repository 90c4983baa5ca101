"""The expert exchange of an MoE block under SPMD expert x tensor.

Every device of a replica's tensor group holds the replica's tokens (the
output of tensor-parallel attention is whole on each device) and routes
them itself, so the replica needs no head to forward rows: the device in
tensor column k keeps the rows of its own experts (expert slot `j * t + k`
on the replica of expert rank j, `tensor_extended.py`) and exchanges them
with the k-th devices of its expert group in an all-to-all, runs its
experts on what it received, and sends the outputs back in a second
all-to-all. The tensor group then all-gathers the outputs of every
column, so each device combines the whole dispatch buffer as one device
does.

Backward, each device's piece of the (replicated) combine gradient goes
back through its own all-to-alls and experts, and the pieces of the
dispatch-buffer gradient are all-gathered over the tensor group: every
expert's input gradient is computed once, by its device, and nothing is a
partial sum (Megatron's scatter / gather pair around the experts).
"""

import tensorflow as tf

from tfpar.engine.per_device import collectives
from tfpar.expert_parallel import comm


def exchange(buffer, expert, tensor_groups, launcher, run_experts, layer):
  """The experts' outputs for `buffer`, in dispatch-buffer order.

  Args:
    buffer: [E * C, h] this replica's dispatch buffer (the same on every
      device of its tensor group); E = expert x t x L experts, C slots
      each.
    expert: the expert-group size.
    tensor_groups: the strategy's `collectives.TensorGroups`.
    launcher: the all-to-all launcher of this device's tensor column
      across the expert group (`Launchers.all_to_all(replica, column)`).
    run_experts: maps received rows [expert, L * C, h] (chunk i from
      member i) through this device's L experts, in the same layout.
    layer: the MoE block's name (for the log).

  Returns:
    [E * C, h], the whole buffer's expert outputs on every device.
  """
  hidden = buffer.shape[-1]
  t = tensor_groups.tensor_size
  by_column = tf.reshape(buffer, [expert, t, -1, hidden])
  # Column k's experts' rows: a slice forward, the slices' gradients
  # all-gathered backward.
  mine = collectives.scatter(tensor_groups, by_column, 1, layer)
  chunks = tf.reshape(mine, [expert, -1, hidden])
  received = comm.all_to_all(chunks, launcher, layer)
  out = comm.all_to_all(run_experts(received), launcher, layer)
  # Every column's outputs on every device; backward each keeps its piece
  # of the replicated gradient.
  whole = collectives.gather(tensor_groups, out[:, None], 1, layer)
  return tf.reshape(whole, [-1, hidden])
