"""The function graphs a traced op calls: a `tf.cond`'s branches, a
`tf.while_loop`'s body, a nested `tf.function`'s graph (PartitionedCall).

`tfpar.monitor` counts a traced training step's FLOPs and collectives,
which sit in such functions under gradient accumulation (the update in a
`tf.cond`) and nested `tf.function`s. TensorFlow registers each called
function in the graph that calls it (or an outer one); no public API looks
one up by name.
"""

from tfpar._compat import checks

# Op attributes naming a called function, and whether its body may run more
# than once per call (a loop's body: counted once, flagged).
_FUNCTION_ATTRS = {"f": False, "then_branch": False, "else_branch": False,
                   "branches": False, "body": True, "cond": True}


def _names(op):
  names = []
  for attr, repeats in _FUNCTION_ATTRS.items():
    if attr not in op.node_def.attr:
      continue
    value = op.node_def.attr[attr]
    if value.HasField("func"):
      names.append((value.func.name, repeats))
    elif value.HasField("list"):
      names.extend((f.name, repeats) for f in value.list.func)
  return names


def _lookup(graph, name):
  while graph is not None:
    get = checks.require(graph, "_get_function",
                         "finding the functions a traced step calls")
    function = get(name)
    if function is not None:
      return function
    graph = getattr(graph, "outer_graph", None)
  return None


def called_graphs(op):
  """[(FuncGraph, repeats)] of the functions `op` calls.

  Args:
    op: a `tf.Operation` of a traced function.

  Returns:
    One (graph, repeats) per called function; `repeats` is True for a
    loop's body or condition, which may run several times per call.

  Raises:
    Incompatible: a called function cannot be found, or has no graph.

  Example:

  >>> import tensorflow as tf
  >>> @tf.function
  ... def f(x):
  ...   return tf.cond(x > 0, lambda: x * 2., lambda: x)
  >>> graph = f.get_concrete_function(tf.TensorSpec([])).graph
  >>> ops = [op for op in graph.get_operations() if op.type.endswith("If")]
  >>> len(called_graphs(ops[0]))
  2
  """
  found = []
  for name, repeats in _names(op):
    function = _lookup(op.graph, name)
    if function is None:
      raise checks.Incompatible(
          f"tfpar cannot find function {name!r} that op {op.name!r} "
          f"({op.type}) calls, in {checks.versions()}: update "
          f"tfpar/_compat/graph_functions.py.")
    found.append((checks.require(function, "graph",
                                 "reading a called function's ops"), repeats))
  return found
