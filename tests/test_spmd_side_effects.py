"""Side effects of SPMD traces are ordered within each device's trace, never
from one device's trace to another's (`tfpar/_compat/side_effects.py`).

TensorFlow's automatic control dependencies chain resource-free stateful
ops (`Assert`) in creation order across the whole function; the traces of
an SPMD step are made one after the other, so that chain linked the last
`Assert` of one device's trace to the first of the next. With collectives
between them that deadlocks (3D stages across workers, and on one host
with batches of unknown size: tests/workers/td_worker.py trains them).
"""

import tensorflow as tf

import tfpar


def _asserting_step(strategy):
  @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
  def step(x):
    def replica_fn(x):
      rows = tf.shape(x)[0]  # Unknown when traced: the Asserts stay.
      tf.debugging.assert_positive(rows, message="first")
      y = x * 2.0
      tf.debugging.assert_positive(rows, message="second")
      return y
    return strategy.run(replica_fn, (x,))
  return step


def _trace_of(op):
  """The replica thread that made `op`: TensorFlow names the ops of
  thread k > 0 under `replica_k/`."""
  first = op.name.split("/")[0]
  return first if first.startswith("replica_") else "replica_0"


def test_each_trace_orders_its_own_asserts_and_no_other_traces():
  # data 2 x tensor 2: four traces, one per device.
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 2}))
  step = _asserting_step(strategy)
  graph = step.get_concrete_function().graph
  asserts = [op for op in graph.get_operations() if op.type == "Assert"]
  traces = [f"replica_{k}" for k in range(4)]
  assert sorted(_trace_of(op) for op in asserts) == sorted(traces * 2)
  for op in asserts:
    for control in op.control_inputs:
      assert _trace_of(control) == _trace_of(op), (op.name, control.name)
  # Within a trace, the second Assert still follows the first.
  for trace in traces:
    first, second = [op for op in asserts if _trace_of(op) == trace]
    assert first in second.control_inputs, (first.name, second.name)
  # And the Asserts still run (they are control outputs of the function).
  result = strategy.experimental_local_results(step(tf.ones([3, 4])))
  assert [float(tf.reduce_sum(r)) for r in result] == [24.0, 24.0]
  assert graph.control_outputs and set(asserts) <= set(graph.control_outputs)
