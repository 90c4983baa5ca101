"""The SPMD memo's record of weights with partial gradients holds their
storages weakly: a storage tfpar.ZeRO(stage=3) replaces (or any storage
no longer used) is freed, and its entry goes with it, while the storages
still alive stay recorded for the gradient sums that read the record.
"""

import gc
import weakref

import keras
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.tensor_parallel.spmd import memo as memo_lib


def _storage(variable):
  return keras_layers.storage(variable, variable)


def _mark_and_drop(mark):
  """Marks a live and a dropped variable with `mark`; returns the live
  one and a weak reference to the dropped one's storage and its id."""
  live = keras.Variable([1.0, 2.0], name="live")
  dropped = keras.Variable([3.0, 4.0], name="dropped")
  mark([live, dropped])
  gone, gone_id = weakref.ref(_storage(dropped)), id(_storage(dropped))
  del dropped
  gc.collect()
  return live, gone, gone_id


def test_partial_weights_do_not_keep_storage_alive():
  memo = memo_lib.Memo(groups=None)
  live, gone, gone_id = _mark_and_drop(memo.mark_partial)
  assert gone() is None
  assert gone_id not in memo.partial_weights
  assert id(_storage(live)) in memo.partial_weights
  assert list(memo.partial_weights.values()) == [_storage(live)]


def test_replaced_storage_is_freed_and_its_successor_recorded():
  memo = memo_lib.Memo(groups=None)
  variable = keras.Variable([1.0, 2.0])
  memo.mark_partial([variable])
  old = weakref.ref(_storage(variable))
  # What ZeRO stage 3 does to a weight: a new storage behind it.
  keras_layers.replace_storage(variable, tf.Variable([1.0, 2.0]))
  gc.collect()
  assert old() is None
  assert not memo.partial_weights  # Read as "no partial weights" by ZeRO.
  memo.mark_partial([variable])  # The next trace marks the new storage.
  assert id(_storage(variable)) in memo.partial_weights


def test_sequence_slices_share_the_weak_record():
  memo = memo_lib.Memo(groups=None, sequence_parallel=True)
  assert memo.slices.partial_weights is memo.partial_weights
  live, gone, gone_id = _mark_and_drop(memo.slices.mark_weights)
  assert gone() is None
  assert gone_id not in memo.partial_weights
  assert id(_storage(live)) in memo.partial_weights
