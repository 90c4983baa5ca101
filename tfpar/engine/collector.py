"""Python's garbage collector kept out of the replica threads.

TensorFlow's mirrored replica threads trace a step one at a time while
the main thread waits for them. Tracing allocates heavily, so Python's
collector often runs inside a replica thread, and collects whatever
garbage the process holds there. A tf.data input iterator left in a
reference cycle by an earlier `fit` (an exception's frames hold one) then
dies in that thread, and its destructor waits for tf.data's own threads:
a step's trace stalled for up to minutes (measured: 276 s in one test
run; `tests/test_backup.py`). While the replica threads trace, the
collector is paused; it runs once on the calling thread before them.
Eager replica functions (`run_eagerly=True`) run every step, where a
collection each time would cost more than it saves: they are left alone.
"""

import contextlib
import gc

import tensorflow as tf


@contextlib.contextmanager
def outside_replica_threads():
  """Runs its body (the replica threads) with automatic collection off,
  after one collection on this thread, when it traces (not eagerly);
  restores the collector's state.

  Example:

  >>> from tfpar.engine.collector import outside_replica_threads
  >>> with outside_replica_threads():
  ...   pass
  """
  if tf.executing_eagerly():
    yield
    return
  was_enabled = gc.isenabled()
  gc.collect()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()
