"""State a layer updates in its call, kept from being updated twice when
its call is recomputed in the backward pass.

ZeRO-3 (`tf.recompute_grad`) and the pipeline's activation recomputation
run a layer's or a stage's call again to rebuild what its gradient needs,
and that second run repeats the call's side effects: batch normalization's
moving mean and variance would take each batch twice (measured: a
`BatchNormalization(synchronized=True)` model under data 4 and ZeRO-3
ended with moving statistics 0.045 away from one device's while its losses
and trainable weights were equal). The first run records which of the
layer's non-trainable variables its call assigns (from the ops it adds to
the traced step); the second run reads them before and assigns them back
after. Only those are touched: frozen weights (LoRA bases, quantized
kernels) are not copied, and variables of others (counters a collective
increments) count the recomputation.
"""

import contextlib

import tensorflow as tf

from tfpar._compat import keras_layers

# Ops that write a resource variable's whole value or add to it; the one
# they write is their first input.
_ASSIGNMENTS = frozenset(("AssignVariableOp", "AssignAddVariableOp",
                          "AssignSubVariableOp"))
# Calls of nested functions: what they do with a variable given to them is
# not looked into, so one given a recorded layer's variable counts as
# assigning it (restoring a variable that was only read costs a copy).
_CALLS = frozenset(("PartitionedCall", "StatefulPartitionedCall"))


class CallState:
  """The variables of a layer that one traced call of it assigns, recorded
  in its first run and restored after its recomputation.

  Args:
    variables: the layer's non-trainable variables (Keras or TensorFlow
      variables, distributed ones included); assignments to others are
      left as they are.

  Example:

  >>> import tensorflow as tf
  >>> statistic, counter = tf.Variable(0.0), tf.Variable(0.0)
  >>> @tf.function
  ... def step():
  ...   state = CallState([statistic])
  ...   with state.recorded():
  ...     statistic.assign_add(1.0)    # the call's side effect
  ...     counter.assign_add(1.0)
  ...   with state.undone():
  ...     statistic.assign_add(1.0)    # repeated by a recomputation
  ...     counter.assign_add(1.0)
  ...   return statistic.read_value(), counter.read_value()
  >>> [float(value) for value in step()]
  [1.0, 2.0]
  """

  def __init__(self, variables):
    self._handles = {id(handle): dtype for handle, dtype
                     in _handles(variables)}
    self._graph = None
    self._assigned = []  # (resource tensor, dtype), in first-write order.

  @contextlib.contextmanager
  def recorded(self):
    """Runs the call's first (forward) run, recording what it assigns."""
    if not self._handles:  # Most layers: nothing to look for.
      yield
      return
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    yield
    seen = set()
    for op in graph.get_operations()[first:]:
      if op.type in _ASSIGNMENTS:
        resources = op.inputs[:1]
      elif op.type in _CALLS:
        resources = [x for x in op.inputs if x.dtype == tf.resource]
      else:
        continue
      for resource in resources:
        dtype = self._handles.get(id(_outermost(resource)))
        if dtype is not None and id(resource) not in seen:
          seen.add(id(resource))
          self._assigned.append((resource, dtype))
    self._graph = graph

  @contextlib.contextmanager
  def undone(self):
    """Runs the call again, leaving every variable its first run assigned
    as that run left it."""
    if not self._assigned:
      yield
      return
    graph = tf.compat.v1.get_default_graph()
    if graph is not self._graph:
      raise RuntimeError(
          "tfpar: a layer's call is recomputed (ZeRO-3 or a pipeline's "
          "recompute=True) in another graph than the one its forward pass "
          "was traced in, so it cannot keep the "
          "variables the call assigns (e.g. batch normalization's moving "
          "statistics) from being updated twice.")
    # Reads and assignments of one resource run in the order they were
    # traced (automatic control dependencies): after the forward's
    # update, and after the recomputation's.
    saved = [tf.raw_ops.ReadVariableOp(resource=resource, dtype=dtype)
             for resource, dtype in self._assigned]
    yield
    for (resource, _), value in zip(self._assigned, saved):
      tf.raw_ops.AssignVariableOp(resource=resource, value=value)


def _handles(variables):
  """The resource handles of `variables`' components, with their dtypes."""
  for variable in variables:
    variable = keras_layers.storage(variable, variable)  # keras.Variable
    for component in getattr(variable, "values", (variable,)):
      handle = getattr(component, "handle", None)
      if handle is not None:
        yield handle, tf.as_dtype(component.dtype).base_dtype


def _outermost(tensor):
  """The tensor a traced function's placeholder captures, followed out
  through nested functions (`tensor` itself when it captures none)."""
  while True:
    graph = getattr(tensor, "graph", None)  # None for eager tensors.
    if hasattr(graph, "outer_graph") and not hasattr(graph, "captures"):
      raise RuntimeError(
          "tfpar: this TensorFlow's FuncGraph has no `captures`, which "
          "tfpar reads to find the variables a recomputed call assigns "
          "(ZeRO-3, a pipeline's recompute=True); "
          "tfpar needs updating for it.")
    external = {id(internal): outer for outer, internal
                in getattr(graph, "captures", ())}.get(id(tensor))
    if external is None:
      return tensor
    tensor = external
