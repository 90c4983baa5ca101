"""Whole-state checkpoints of a ZeRO optimizer.

A ZeRO optimizer saves exactly what the unsharded optimizer would: every
slot as one full-shape tensor, in the same order, without the weight
slices. So a checkpoint written under N replicas loads under any other
number of replicas, with or without ZeRO, and vice versa.
"""

import numpy as np

from tfpar.zero import sharded_optimizer
from tfpar.zero import slices


def install(optimizer):
  """Gives a ZeRO optimizer `save_own_variables` / `load_own_variables`
  that read and write whole logical tensors (Keras `.weights.h5`,
  `.keras`, `ModelCheckpoint`, `BackupAndRestore`).

  Args:
    optimizer: an optimizer `sharded_optimizer.shard` has prepared.
  """
  state = optimizer._tfpar_zero  # pylint: disable=protected-access

  def save_own_variables(store):
    entries = sharded_optimizer.logical_entries(optimizer)
    for index, (variable, reference) in enumerate(entries):
      if reference is None:
        store[str(index)] = np.asarray(variable.numpy())
      else:
        store[str(index)] = slices.whole(variable, reference.shape)

  def load_own_variables(store):
    entries = sharded_optimizer.logical_entries(optimizer)
    if len(store.keys()) != len(entries):
      raise ValueError(
          f"Optimizer {optimizer.name!r} has {len(entries)} logical "
          f"variables but the checkpoint lists {len(store.keys())}.")
    for index, (variable, reference) in enumerate(entries):
      value = np.asarray(store[str(index)])
      if reference is None:
        variable.assign(value)
      else:
        slices.assign_whole(variable, value, state.replicas,
                            state.replica_ids)

  object.__setattr__(optimizer, "save_own_variables", save_own_variables)
  object.__setattr__(optimizer, "load_own_variables", load_own_variables)
