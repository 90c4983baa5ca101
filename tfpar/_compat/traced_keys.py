"""Instance keys of collectives drawn when a step is traced.

TensorFlow's collective launchers feed each collective a new instance key
at every call of the traced function (`capture_call_time_value`). tfpar's
launchers in one process take keys fixed when the step is traced instead:

* Keras runs `compile(steps_per_execution=N)` as N steps inside a
  `tf.cond` in a `tf.while_loop`, calling its step function from there;
  the step function captures the call-time key, and TensorFlow cannot feed
  that capture through the loop's branch ("You must feed a value for
  placeholder tensor"; stock `MirroredStrategy` fails the same way,
  keras-team/keras#19246).
* TensorFlow's runtime keeps a record per key for the life of the process,
  about 300 bytes per key and device: with a new key at every call a
  process grows at every step (a 2-layer MLP under data 4: about 1.5 KB per
  step, benchmarks/bench_instance_keys.py).

Eager collectives keep TensorFlow's keys.

The k-th collective traced on a group's device gets the k-th key of the
group's device, as every member traces the same step (valid only when
every member of the group is in this process). TensorFlow pins a key's
shape, and a collective of a sparse gradient's rows, of activations or of
routed tokens changes shape between calls (the last, shorter batch of an
epoch), so a collective whose shape the trace leaves open takes one of 511
keys by its runtime shape, computed in the graph: all members of one call
have the same shape (the launchers' rule) and so the same key. Two shapes
of one collective share a key only if their hashes collide, which
TensorFlow reports ("Shape mismatch in the collective instance"), never a
wrong sum.
"""

import threading

import tensorflow as tf

from tfpar._compat.checks import require

# Below `distribute.FIXED_INSTANCE_KEYS`, far above TensorFlow's own keys
# (from 100, one per collective launched).
TRACED_INSTANCE_KEYS = range(1 << 29, 1 << 30)
_KEYS_PER_COLLECTIVE = 512  # 0: a static shape; 1-511: by runtime shape.
_PRIMES = (1_000_003, 7_919, 104_729, 15_485_863, 2_750_159, 611_953)

_traced = {}  # (group key, device) -> collectives traced so far.
_traced_lock = threading.Lock()  # Replicas are traced in threads.
_input = threading.local()  # The input of the collective being launched.


class keyed_by:  # pylint: disable=invalid-name
  """Context: the collective launched inside takes its traced key from
  `tensor`'s shape (for collectives tfpar builds on a launcher's key)."""

  def __init__(self, tensor):
    self._tensor = tensor

  def __enter__(self):
    self._previous = getattr(_input, "tensor", None)
    _input.tensor = self._tensor

  def __exit__(self, *exc):
    _input.tensor = self._previous


def _traced_key(group_key, device):
  with _traced_lock:
    n = _traced.get((group_key, device), 0)
    _traced[group_key, device] = n + 1
  base = TRACED_INSTANCE_KEYS.start + n * _KEYS_PER_COLLECTIVE
  if base + _KEYS_PER_COLLECTIVE > TRACED_INSTANCE_KEYS.stop:
    most = len(TRACED_INSTANCE_KEYS) // _KEYS_PER_COLLECTIVE
    raise ValueError(
        f"tfpar traced more than {most} collectives of group {group_key} on "
        f"{device}, more than its instance keys {TRACED_INSTANCE_KEYS} "
        f"hold; restart the process.")
  tensor = getattr(_input, "tensor", None)
  with tf.device("CPU:0"):
    if tensor is None or tensor.shape.is_fully_defined():
      return tf.constant(base, tf.int32)
    shape = tf.cast(tf.shape(tensor), tf.int64)
    weights = tf.constant([_PRIMES[i % len(_PRIMES)] + i
                           for i in range(tensor.shape.rank)], tf.int64)
    slot = 1 + tf.math.floormod(tf.reduce_sum(shape * weights),
                                _KEYS_PER_COLLECTIVE - 1)
    return tf.cast(base + slot, tf.int32)


def draw_keys_when_traced(launchers_of_group):
  """Makes each `CollectiveReplicaLauncher` given take keys fixed when its
  collectives are traced (TensorFlow's when they run eagerly). Only valid
  when every member of each launcher's group is in this process."""
  for launcher in launchers_of_group:
    original_key = require(launcher, "_next_instance_key", "instance keys")
    group_key = require(launcher, "_group_key", "collective group key")
    device = require(launcher, "_device", "collective device")

    def next_instance_key(original_key=original_key, group_key=group_key,
                          device=device):
      if tf.executing_eagerly():
        return original_key()
      return _traced_key(group_key, device)

    launcher._next_instance_key = next_instance_key  # pylint: disable=protected-access
    for name in ("all_reduce", "_all_gather"):
      _key_by_first_argument(launcher, name)


def _key_by_first_argument(launcher, name):
  launch = require(launcher, name, "collective launches")

  def keyed(tensor, *args, **kwargs):
    with keyed_by(tf.convert_to_tensor(tensor)):
      return launch(tensor, *args, **kwargs)

  setattr(launcher, name, keyed)
