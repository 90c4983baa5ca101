"""What `tfpar.ZeRO` asks of a per-device (SPMD) strategy: hooks on its
extended, looked up by name, so neither ZeRO nor the parallelisms import
each other.

Under SPMD every variable has a component on each `data x tensor` device
(replica-major) and every device traces the step. ZeRO slices each
component over the data replicas within its tensor column (Megatron +
DeepSpeed: ZeRO over the data-parallel group of each tensor rank): the
trace on the k-th device of replica r keeps slice r of its component and
runs ZeRO's collectives among the k-th devices of every replica.
"""

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import keras_layers
from tfpar.common import instrument
from tfpar.engine.per_device import collectives


class ZeroHooks:
  """Mixin of `PerDeviceExtended` (tensor parallelism, tensor-parallel stages)
  (needs `tensor_size`, `_groups`, `_sequence_parallel` and
  `partial_weights`: the weights whose gradients are partial)."""

  @property
  def zero_traces_per_replica(self):
    """Components of every variable per data replica (one per device)."""
    return self.tensor_size

  @property
  def zero_recomputes(self):
    """Whether ZeRO-3 may run a layer's call again in its backward pass
    (gathering its weights again there). Not under sequence parallelism:
    its gathers of the sequence mark the tensors they hand the split
    layers (`Slices.gathered`: `f` done), and a recomputed call would get
    unmarked copies and apply `f` again, summing input gradients twice
    over the group. Gathered weights then live until the backward pass."""
    return not self._sequence_parallel

  def zero_trace(self, column=None):
    """(the device column of ZeRO's group, index among this worker's data
    replicas) of the trace running now, or None outside a replica.

    Args:
      column: the first device column of the weight's devices (0 here;
        a pipeline stage's first under SPMD 3D); the trace's is that plus
        its index in the tensor group.
    """
    slot = collectives.current_slot()
    if slot is None:
      return None
    return ((column or 0) + slot.tensor_index,
            slot.device_index // self.tensor_size)

  def zero_gather_columns(self, wholes):
    """Each of `wholes` (this trace's tensor column's whole vectors) as
    `[tensor, n]`: every column's, gathered over the tensor group (saving
    a multi-worker ZeRO state: only the groups' first devices' results
    leave a replica).

    Args:
      wholes: vectors of equal length on every device of a group.
    """
    slot = collectives.current_slot()
    if slot is None:
      return [tf.expand_dims(w, 0) for w in wholes]
    launcher = self._groups.launcher(slot.device_index)
    return [distribute.all_gather(launcher, tf.expand_dims(w, 0))
            for w in wholes]

  def zero_partial_gradients(self, grads, variables):
    """`grads` with those of replicated weights that are partial on each
    device (applied to sequence slices; shared key/value heads) summed
    over the tensor group, before ZeRO reduces them over the data replicas.

    Args:
      grads: this trace's gradients (None for a weight without one).
      variables: their Keras variables.
    """
    partial = self.partial_weights
    if collectives.current_slot() is None or not partial:
      return grads
    return [
        collectives.all_reduce(self._groups, tf.convert_to_tensor(g),
                               v.name, instrument.BACKWARD)
        if g is not None and id(keras_layers.storage(v)) in partial else g
        for g, v in zip(grads, variables)]

  def zero_sum_over_shards(self, squares, variables):
    """Per-weight sums of squared gradients (each whole over the data
    replicas already) with those of split weights summed over the tensor
    group: the squared norms of the whole weights (clipping).

    Args:
      squares: a vector, one sum per variable.
      variables: the Keras variables (a split one has `_tfpar_shard_of`).
    """
    split = [i for i, v in enumerate(variables)
             if getattr(v, "_tfpar_shard_of", None) is not None]
    if not split or collectives.current_slot() is None:
      return squares
    summed = collectives.all_reduce(self._groups, tf.gather(squares, split),
                                    "zero clipping", instrument.BACKWARD)
    return tf.tensor_scatter_nd_update(squares, [[i] for i in split], summed)
