"""Side effects of the SPMD traces ordered per device, not across devices.

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

from tensorflow.python.framework import auto_control_deps
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


def _chained_function_wide(op):
  """Whether automatic control dependencies put `op` in the chain of
  resource-free side effects (`AutomaticControlDependencies.__exit__`)."""
  return (_IS_STATEFUL(op) and
          getattr(op, "_control_flow_context", None) is None and
          not any(t.dtype == dtypes.resource for t in op.inputs))
