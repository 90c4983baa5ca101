"""Stock `tf.distribute.MirroredStrategy` that can share a process.

Every stock MirroredStrategy takes collective group key 1, so a second one
over a different number of devices in the same process fails its first
all-reduce ("is joining a group with size4, but that group has size 2
(group_key=1)"), and the abort poisons every later collective of the
process. Tests compare tfpar with stock strategies of several sizes in one
pytest process, so each stock strategy here gets its own key range, far
above the ones tfpar's strategies take.
"""

import itertools

import tensorflow as tf

_FIRST_KEY_BASE = 1_000_000_000
_KEY_BASE_STRIDE = 100_000
_key_bases = itertools.count()


def mirrored(devices):
  """A stock MirroredStrategy over `devices` with collective keys of its own."""
  base = _FIRST_KEY_BASE + next(_key_bases) * _KEY_BASE_STRIDE
  strategy_class = type("MirroredStrategy", (tf.distribute.MirroredStrategy,),
                        {"_collective_key_base": base})
  return strategy_class(devices=list(devices))
