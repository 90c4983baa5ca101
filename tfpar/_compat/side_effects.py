"""Side effects of the SPMD traces ordered per device, not across devices
(and of TensorFlow's replica threads per replica: `order_per_replica`).

Inside a `tf.function`, TensorFlow's automatic control dependencies chain
every stateful op that takes no resource (an `Assert`, a `PrintV2`) after
the previous one, in the order the ops were created. Under SPMD a step
is traced once per device, one trace after the other, so that chain runs
from the last such op of one device's trace to the first of the next
device's: a control edge between two devices' programs. Where a device's
first side effect comes before a collective that the other device's last
side effect waits for, the step deadlocks. Measured: a pipeline of
tensor-parallel stages whose batch size is unknown when traced (a
`dataset.batch(n)` without `drop_remainder`, or any mesh across workers)
keeps the loss's shape `Assert`s, and hung in stage 1's third tensor-group
all-reduce: the second column's first `Assert` waited for the first
column's last, which came after that all-reduce.

`SideEffects` records the ops each device's trace creates and, once all
traces are made, takes their resource-free side effects out of that chain
(the graph's `experimental_acd_manager.run_independently`, TensorFlow's
hook for ops whose order does not matter to the rest of the function) and
chains them per device instead, in the order the device's trace made
them, as one device's function orders them. They still run: independent
ops are among the function's control outputs.
"""

# Only `tensorflow.python` modules: with `import tensorflow` here, autograph
# converted this module's methods inside keras-hub's traced `generate`
# (measured: a TypeError from `SideEffects.__init__`).
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.framework import device_spec
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import ops

from tfpar._compat.checks import require

_IS_STATEFUL = require(auto_control_deps, "op_is_stateful",
                       "ordering side effects per device under SPMD")
_ADD_CONTROL_INPUT = require(ops.Operation, "_add_control_input",
                             "ordering side effects per device under SPMD")
require(auto_control_deps.AutomaticControlDependencies, "run_independently",
        "ordering side effects per device under SPMD")


class SideEffects:
  """The ops each device's trace creates in `graph`, by device index."""

  def __init__(self, graph, devices):
    self._graph = graph
    self._created = [[] for _ in range(devices)]
    self._start = None

  def start(self):
    """Marks the start of a device's turn (only its thread adds ops)."""
    self._start = self._graph.num_operations()

  def end(self, index):
    """Credits the ops made since `start` to device `index`."""
    self._created[index].extend(self._graph.get_operations()[self._start:])

  def credit(self, index, op):
    """Credits `op` to device (or replica) `index`."""
    self._created[index].append(op)

  def order_per_device(self):
    """Chains each device's resource-free side effects in its own order,
    out of the function-wide chain. Outside a function that adds
    automatic control dependencies, nothing to do."""
    if not getattr(self._graph, "_add_control_dependencies", False):
      return
    manager = getattr(self._graph, "experimental_acd_manager", None)
    if manager is None:
      raise RuntimeError(
          "tfpar orders each SPMD trace's side effects through the graph's "
          "experimental_acd_manager, which this TensorFlow's function "
          "graphs do not set: update tfpar/_compat/side_effects.py.")
    for created in self._created:
      previous = None
      for op in created:
        if not _chained_function_wide(op):
          continue
        manager.run_independently(op)
        if previous is not None:
          _ADD_CONTROL_INPUT(op, previous)
        previous = op


def order_per_replica(graph, first_op, replica_devices):
  """`SideEffects.order_per_device` for the ops a `tf.distribute` replica
  function made in `graph` from its `first_op`-th op on, credited to the
  replica whose devices place them (`replica_devices`: each replica's
  device names). TensorFlow's mirrored replica threads take turns at
  their merge points, so their ops interleave in the function-wide chain
  as the devices' traces of SPMD follow each other. Measured: a pipeline
  with expert parallelism whose batch size the trace leaves open (the
  last, shorter batch of an epoch) hung in its first step; each replica's
  loss `Assert`s waited, through the chain, for the other replica's, which
  came after an all-to-all of routed tokens."""
  replica_of = {_local_device(d): index
                for index, devices in enumerate(replica_devices)
                for d in devices}
  effects = SideEffects(graph, len(replica_devices))
  for op in graph.get_operations()[first_op:]:
    if op.device and _chained_function_wide(op):
      index = replica_of.get(_local_device(op.device))
      if index is not None:
        effects.credit(index, op)
  effects.order_per_device()


def _local_device(name):
  """A device of this worker, by its type and index."""
  spec = device_spec.DeviceSpecV2.from_string(name)
  return spec.device_type, spec.device_index


def _chained_function_wide(op):
  """Whether automatic control dependencies put `op` in the chain of
  resource-free side effects (`AutomaticControlDependencies.__exit__`)."""
  return (_IS_STATEFUL(op) and
          getattr(op, "_control_flow_context", None) is None and
          not any(t.dtype == dtypes.resource for t in op.inputs))
