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

Losses the call's layers add (`add_loss`, activity regularizers) are
the other side effect: `AddedLosses` keeps their gradients under
`tf.recompute_grad`, which runs the first call off the gradient tape.
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


class AddedLosses:
  """The losses the layers of a recomputed call add (`add_loss`, a nested
  layer's activity regularizer), made outputs of the recomputed function.

  The first run of `tf.recompute_grad` runs with the gradient tape
  stopped, so a loss a nested layer adds there is a constant to the tape:
  its gradient was silently lost (measured: a Dense chain with activity
  regularizers under data 4 + ZeRO-3 ended 6e-4 from one device, the
  regularizer's whole gradient missing; keras-hub's MoE decoders add
  their router loss this way). Returned from the recomputed function
  instead, each loss takes its gradient through the recomputation, and
  the layer's list holds that returned tensor. The recomputation's own
  additions are dropped.

  Args:
    layer: the layer whose call is recomputed (its nested layers
      included).

  Example:

  >>> import keras, tensorflow as tf
  >>> class Penalized(keras.layers.Layer):
  ...   def call(self, x):
  ...     self.add_loss(tf.reduce_sum(x * x))
  ...     return 2.0 * x
  >>> layer = Penalized()
  >>> losses = AddedLosses(layer)
  >>> x = tf.constant([1.0, 3.0])
  >>> with tf.GradientTape() as tape:
  ...   tape.watch(x)
  ...   y = tf.recompute_grad(losses.returning(layer.call))(x)
  ...   total = tf.reduce_sum(losses.placed(y)) + sum(layer.losses)
  >>> tape.gradient(total, x).numpy().tolist()  # 2 + 2 x
  [4.0, 8.0]
  """

  def __init__(self, layer):
    self._lists = [keras_layers.own_losses(sub)
                   for sub in keras_layers.flatten_layers(layer)]
    self._runs = 0
    self._places = None  # (list, index) of each loss the first run added.

  def returning(self, call):
    """`call`, returning (outputs, losses it added) when its first run
    added losses, else its outputs."""
    def run(*args, **kwargs):
      self._runs += 1
      before = [list(losses) for losses in self._lists]
      outputs = call(*args, **kwargs)
      # By identity: a nested layer called outside its model's call (the
      # recomputation) empties its list before it adds to it.
      added = []
      for losses, kept in zip(self._lists, before):
        old = {id(loss) for loss in kept}
        added.extend((losses, index) for index, loss in enumerate(losses)
                     if id(loss) not in old)
      tensors = [losses[index] for losses, index in added]
      if self._runs == 1:
        self._places = added
      else:  # The recomputation's own copies go; the lists stay as were.
        for losses, kept in zip(self._lists, before):
          losses[:] = kept
        if len(tensors) != len(self._places):
          raise RuntimeError(
              f"tfpar: a recomputed call added {len(tensors)} losses where "
              f"its first run added {len(self._places)}; their gradients "
              f"cannot be matched.")
      return (outputs, tensors) if self._places else outputs
    return run

  def placed(self, result):
    """The call's outputs from what `returning(call)` returned, each loss
    it added replaced in its layer's list by the returned tensor."""
    if not self._places:
      return result
    outputs, tensors = result
    for (losses, index), tensor in zip(self._places, tensors):
      losses[index] = tensor
    return outputs
