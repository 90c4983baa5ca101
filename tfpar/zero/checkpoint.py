"""Whole-state checkpoints of a ZeRO optimizer.

A ZeRO optimizer saves exactly what the unsharded optimizer would: every
slot as one full-shape tensor, in the same order, without the weight
slices. So a checkpoint written under N replicas loads under any other
number of replicas, with or without ZeRO, and vice versa.
"""

import contextlib

import numpy as np

from tfpar.common import split_weights
from tfpar.common.split_weights import LogicalTensor
from tfpar.common.split_weights import sharded_weights
from tfpar.engine import whole_state
from tfpar.memory import components
from tfpar.zero import sharded_optimizer
from tfpar.zero import slices
from tfpar.zero import spread_slices


class WholeSlot:
  """A sliced optimizer slot seen as the full-shape tensor it slices.

  Args:
    slot: the slice variable.
    reference: the weight (or tensor-parallel shard) it belongs to.
    state: the optimizer's `ZeroState`.
    columns: under SPMD tensor parallelism (`state.columns` components
      per replica), the columns whose components hold the slot's slices
      (read from the first, written to all); None: every component.
  """

  def __init__(self, slot, reference, state, columns=None):
    self._slot, self._state, self._columns = slot, state, columns
    self.name = slot.name
    self.shape = tuple(reference.shape)

  def _parts(self, column):
    if self._columns is None:
      return None
    return list(components(self._slot))[column::self._state.columns]

  def numpy(self):
    first = None if self._columns is None else self._columns[0]
    return slices.whole(self._slot, self.shape, self._parts(first),
                        first or 0)

  def assign(self, value):
    value = np.asarray(value)
    if tuple(value.shape) != self.shape:
      raise ValueError(
          f"Cannot load a value of shape {tuple(value.shape)} into "
          f"optimizer variable {self.name!r} of shape {self.shape}.")
    for column in self._columns or (None,):
      slices.assign_whole(self._slot, value, self._state.replicas,
                          self._state.replica_ids, self._parts(column))


class _ColumnView:
  """An unsliced variable's components in one SPMD column (a split
  weight's whole-shard gradient accumulator under stage 1)."""

  def __init__(self, variable, column, columns):
    self._parts = list(components(variable))[column::columns]
    self.shape = tuple(variable.shape)

  def numpy(self):
    return self._parts[0].numpy()

  def assign(self, value):
    for part in self._parts:
      part.assign(value)


def _whole(variable, reference, state):
  """The whole view of an optimizer variable of `reference`'s."""
  sliced = id(variable) in state.slot_references
  columns = state.columns
  if columns == 1:
    return WholeSlot(variable, reference, state) if sliced else variable
  split = getattr(reference, "_tfpar_shard_of", None)
  if split is None:  # Replicated: every column holds the same state.
    return (WholeSlot(variable, reference, state, list(range(columns)))
            if sliced else variable)
  return LogicalTensor(
      [WholeSlot(variable, reference, state, [k]) if sliced else
       _ColumnView(variable, k, columns) for k in range(columns)],
      split[0].axis)


def _entries(optimizer, model):
  state = optimizer._tfpar_zero  # pylint: disable=protected-access
  entries = []
  for v, reference in sharded_optimizer.logical_entries(optimizer):
    if reference is None:
      reference = state.unsliced_references.get(id(v))
    entries.append(v if reference is None else _whole(v, reference, state))
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
