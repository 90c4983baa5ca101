"""Optimizer state saved as one device saves it, however it is split.

Tensor parallelism (shards), expert parallelism (each replica's own
experts) and ZeRO (slices) keep a weight's slots split over devices; Keras's
`save_own_variables` / `load_own_variables` must still write and read the
whole slots, in the order of an unsplit optimizer, so that checkpoints load
into any layout or none. This is the one implementation; a checkpoint
listing another number of variables is skipped with a warning, as Keras's
own optimizers do (layers raise, as Keras's layers do:
`tfpar.common.split_weights.install_logical_saving`).

Example:

>>> import keras
>>> optimizer = keras.optimizers.SGD(momentum=0.9)
>>> optimizer.build([keras.Variable([1.0, 2.0])])
>>> save_whole_state(optimizer, lambda: list(optimizer.variables))
>>> store = {}
>>> optimizer.save_own_variables(store)
>>> sorted(store)
['0', '1', '2']
"""

import warnings

import numpy as np


def save_whole_state(optimizer, whole_entries):
  """Makes `optimizer` save and load the entries `whole_entries()` gives.

  Args:
    optimizer: a Keras optimizer.
    whole_entries: a function returning the optimizer's variables in
      order, each split slot as an object whose `numpy()` and `assign`
      read and write the whole slot.
  """

  def save_own_variables(store):
    for index, entry in enumerate(whole_entries()):
      store[str(index)] = np.asarray(entry.numpy())

  def load_own_variables(store):
    entries = whole_entries()
    if len(store.keys()) != len(entries):
      warnings.warn(
          f"Skipping variable loading for optimizer {optimizer.name!r}: it "
          f"has {len(entries)} whole variables and the checkpoint "
          f"{len(store.keys())}. Build the optimizer first "
          f"(optimizer.build(model.trainable_variables)).", stacklevel=2)
      return
    for index, entry in enumerate(entries):
      entry.assign(np.asarray(store[str(index)]))

  object.__setattr__(optimizer, "save_own_variables", save_own_variables)
  object.__setattr__(optimizer, "load_own_variables", load_own_variables)
