"""An independent run-time count of the all-reduces an optimizer's update
launches, for the tests and the accumulation benchmark.

Imported by `tests/test_gradient_accumulation.py` and by
`benchmarks/bench_accumulation.py` (which puts this directory on its path).
"""

import collections
import contextlib
import threading

import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from tensorflow.python.ops import collective_ops


@contextlib.contextmanager
def update_all_reduces():
  """Counts, at run time, the all-reduces launched by the optimizer's
  update (not Keras's metric or first-batch reductions): counter variables
  incremented by a control dependency of each collective, so a collective
  in a `tf.cond` branch counts only when that branch runs. Each device has
  its own counters (a counter shared by the replicas would order their
  conds one after the other, and their collectives would wait forever).

  Yields:
    A dict that holds, once the block ends, "executions" (all-reduces run,
    summed over devices) and "bytes" (their inputs' bytes).
  """
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  with tf.init_scope():
    counters = {}
    for device in devices:
      with tf.device(device):
        counters[tf.DeviceSpec.from_string(device).device_index] = (
            tf.Variable(0, dtype=tf.int64, trainable=False),
            tf.Variable(0, dtype=tf.int64, trainable=False))
  # Replica threads inside their update step (by thread id). Other replica
  # threads trace their forward pass meanwhile (tfpar's spmd=True traces
  # one per device; its layers all-reduce activations): only the update's
  # own thread counts, and the merge function it calls, which runs in the
  # cross-replica context while the replica threads wait in the update.
  inside_update = collections.Counter()
  original_reduce = collective_ops.all_reduce_v2
  original_update = tf_optimizer.TFOptimizer._backend_update_step

  def launched_by_update():
    if inside_update[threading.get_ident()]:
      return True
    return (tf.distribute.in_cross_replica_context() and
            any(inside_update.values()))

  def all_reduce_v2(t, *args, **kwargs):
    result = original_reduce(t, *args, **kwargs)
    if not launched_by_update():
      return result
    executions, sent = counters[
        tf.DeviceSpec.from_string(result.device).device_index]
    nbytes = t.shape.num_elements() * t.dtype.size
    with tf.control_dependencies([result]):
      counted = tf.group(executions.assign_add(1), sent.assign_add(nbytes))
    with tf.control_dependencies([counted]):
      return tf.identity(result)

  def update_step(self, *args, **kwargs):
    inside_update[threading.get_ident()] += 1
    try:
      return original_update(self, *args, **kwargs)
    finally:
      inside_update[threading.get_ident()] -= 1

  totals = {}
  collective_ops.all_reduce_v2 = all_reduce_v2
  tf_optimizer.TFOptimizer._backend_update_step = update_step
  try:
    yield totals
  finally:
    collective_ops.all_reduce_v2 = original_reduce
    tf_optimizer.TFOptimizer._backend_update_step = original_update
    totals["executions"] = sum(int(e.numpy()) for e, _ in counters.values())
    totals["bytes"] = sum(int(b.numpy()) for _, b in counters.values())


@contextlib.contextmanager
def gathers_and_all_to_alls():
  """Counts, at run time, every all-gather and all-to-all that runs while
  the block is open, in functions traced inside it (ZeRO's collectives:
  its reduce-scatter is an all-to-all on CPU), whoever launches them: a
  counter per device incremented by a control dependency of each
  collective, wrapping TensorFlow's own `collective_ops` functions.

  Yields:
    A dict that holds, once the block ends, for "all-gather" and
    "all-to-all", the executions summed over devices and, under
    "<kind> bytes", the bytes of their inputs summed over devices.
  """
  kinds = {"all-gather": "all_gather_v2", "all-to-all": "all_to_all_v2"}
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  with tf.init_scope():
    counters = {}
    for device in devices:
      with tf.device(device):
        index = tf.DeviceSpec.from_string(device).device_index
        for kind in kinds:
          counters[index, kind] = (
              tf.Variable(0, dtype=tf.int64, trainable=False),
              tf.Variable(0, dtype=tf.int64, trainable=False))
  originals = {kind: getattr(collective_ops, name)
               for kind, name in kinds.items()}

  def counting(kind):
    def launch(t, *args, **kwargs):
      result = originals[kind](t, *args, **kwargs)
      executions, sent = counters[
          tf.DeviceSpec.from_string(result.device).device_index, kind]
      nbytes = t.shape.num_elements() * t.dtype.size
      with tf.control_dependencies([result]):
        counted = tf.group(executions.assign_add(1),
                           sent.assign_add(nbytes))
      with tf.control_dependencies([counted]):
        return tf.identity(result)
    return launch

  totals = {}
  for kind, name in kinds.items():
    setattr(collective_ops, name, counting(kind))
  try:
    yield totals
  finally:
    for kind, name in kinds.items():
      setattr(collective_ops, name, originals[kind])
    for kind in kinds:
      totals[kind] = sum(int(counters[key][0].numpy()) for key in counters
                         if key[1] == kind)
      totals[f"{kind} bytes"] = sum(int(counters[key][1].numpy())
                                    for key in counters if key[1] == kind)
