"""Whole-state checkpoints of a ZeRO optimizer.

A ZeRO optimizer saves exactly what the unsharded optimizer would: every
slot as one full-shape tensor, in the same order, without the weight
slices. So a checkpoint written under N replicas loads under any other
number of replicas, with or without ZeRO, and vice versa.
"""

import contextlib

import numpy as np

from tfpar.common import split_weights
from tfpar.common.split_weights import sharded_weights
from tfpar.engine import whole_state
from tfpar.zero import sharded_optimizer
from tfpar.zero import slices
from tfpar.zero import spread_slices


class WholeSlot:
  """A sliced optimizer slot seen as the full-shape tensor it slices.

  Args:
    slot: the slice variable.
    reference: the weight (or tensor-parallel shard) it belongs to.
    state: the optimizer's `ZeroState`.
  """

  def __init__(self, slot, reference, state):
    self._slot, self._state = slot, state
    self.name = slot.name
    self.shape = tuple(reference.shape)

  def numpy(self):
    return slices.whole(self._slot, self.shape)

  def assign(self, value):
    value = np.asarray(value)
    if tuple(value.shape) != self.shape:
      raise ValueError(
          f"Cannot load a value of shape {tuple(value.shape)} into "
          f"optimizer variable {self.name!r} of shape {self.shape}.")
    slices.assign_whole(self._slot, value, self._state.replicas,
                        self._state.replica_ids)


def _entries(optimizer, model):
  state = optimizer._tfpar_zero  # pylint: disable=protected-access
  entries = [v if reference is None else WholeSlot(v, reference, state)
             for v, reference in sharded_optimizer.logical_entries(optimizer)]
  weights = sharded_weights(model)
  if weights:  # Tensor parallelism too: shards' slots become whole slots.
    entries = split_weights.logical_entries(entries, weights)
  return entries


def install(optimizer, model):
  """Gives a ZeRO optimizer `save_own_variables` / `load_own_variables`
  that read and write whole logical tensors (Keras `.weights.h5`,
  `.keras`, `ModelCheckpoint`, `BackupAndRestore`).

  Args:
    optimizer: an optimizer `sharded_optimizer.shard` has prepared.
    model: its model.
  """
  whole_state.save_whole_state(optimizer, lambda: _entries(optimizer, model))


def whole_values(model):
  """A context in which the whole values of `model`'s ZeRO slices (the
  optimizer state, and the weights under stage 3) are gathered once from
  every worker, for saving. In a multi-worker job every worker enters it,
  at the same point; elsewhere it does nothing.

  Args:
    model: a Keras model, trained under `tfpar.ZeRO` or not.
  """
  state = getattr(getattr(model, "optimizer", None), "_tfpar_zero", None)
  if state is None:  # No ZeRO, or not even compiled.
    return contextlib.nullcontext()
  sliced = [v for v in model.optimizer.variables
            if id(v) in state.slot_references]
  if state.stage == 3:
    sliced += [entry.weight for entry in state.entries.values()]
  return spread_slices.prefetched(sliced)
