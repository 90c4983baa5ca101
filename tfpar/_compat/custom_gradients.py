"""Gradients of `tf.custom_gradient` that live as long as their graph.

Traced in a `tf.function`, every `tf.custom_gradient` call registers its
gradient function in TensorFlow's process-wide gradient registry under a
fresh name ("CustomGradient-<uid>") and never removes it. That function
closes over the traced tensors, so the registry keeps every such graph
(and the model, optimizer and step it traced) alive for the life of the
process. tfpar's collectives are custom gradients, so each retrace of a
parallel step leaked a whole step graph: in one test process, after 7
other test files, a file took 103 CPU s instead of 39 (the garbage
collector walking 4.5 million leaked objects).

`hold_custom_gradients_on_their_graphs()` makes the registry hold each
such gradient through its graph instead: the graph it was traced into
keeps it, the registry keeps the graph only weakly and forgets the name
when the graph is collected. Nothing can look the gradient up after that:
it differentiates ops of that graph only.
"""

import threading
import weakref

from tensorflow.python.framework import ops  # pylint: disable=g-direct-tensorflow-import

from tfpar._compat import checks

_PREFIX = "CustomGradient-"
_ATTRIBUTE = "_tfpar_custom_gradients"
_LOCK = threading.Lock()


class _HeldByGraph:
  """A registry entry whose contents the graph it was traced into holds."""

  __slots__ = ("_graph", "_name")

  def __init__(self, graph, name):
    self._graph = weakref.ref(graph)
    self._name = name

  def __getitem__(self, key):
    graph = self._graph()
    if graph is None:
      raise LookupError(f"{self._name}: its graph was collected")
    return getattr(graph, _ATTRIBUTE)[self._name][key]


class _GraphScopedRegistry(dict):
  """TensorFlow's gradient registry, holding custom gradients by graph."""

  def __setitem__(self, name, entry):
    if not (isinstance(name, str) and name.startswith(_PREFIX)):
      return super().__setitem__(name, entry)
    graph = ops.get_default_graph()
    held = getattr(graph, _ATTRIBUTE, None)
    if held is None:
      held = {}
      setattr(graph, _ATTRIBUTE, held)
      # The finalizer holds the names only: holding `held` would keep the
      # graph alive through the gradients' closures.
      names = []
      setattr(graph, _ATTRIBUTE + "_names", names)
      weakref.finalize(graph, _forget, weakref.ref(self), names)
    held[name] = entry
    getattr(graph, _ATTRIBUTE + "_names").append(name)
    super().__setitem__(name, _HeldByGraph(graph, name))


def _forget(registry_ref, names):
  registry = registry_ref()
  if registry is not None:
    for name in names:
      registry.pop(name, None)


def _registry_and_entries():
  """TensorFlow's gradient registry and the dict of its entries."""
  purpose = "releasing custom gradients with their graph"
  registry = checks.require(ops, "_gradient_registry", purpose)
  return registry, checks.require(registry, "_registry", purpose)


def hold_custom_gradients_on_their_graphs():
  """Installs the graph-scoped registry (once per process; idempotent).

  Returns:
    The number of entries the registry held when it was installed.

  >>> hold_custom_gradients_on_their_graphs() >= 0
  True
  """
  with _LOCK:
    registry, entries = _registry_and_entries()
    if isinstance(entries, _GraphScopedRegistry):
      return len(entries)
    if type(entries) is not dict:  # pylint: disable=unidiomatic-typecheck
      raise checks.Incompatible(
          f"tfpar expected TensorFlow's gradient registry to be a dict, "
          f"found {type(entries).__name__} ({checks.versions()})")
    scoped = _GraphScopedRegistry(entries)
    registry._registry = scoped  # pylint: disable=protected-access
    return len(scoped)


def installed():
  """Whether the graph-scoped registry is installed in this process.

  >>> hold_custom_gradients_on_their_graphs() >= 0 and installed()
  True
  """
  return isinstance(_registry_and_entries()[1], _GraphScopedRegistry)


def registered_custom_gradients():
  """How many traced custom gradients TensorFlow's registry names now.

  >>> registered_custom_gradients() >= 0
  True
  """
  return sum(1 for name in _registry_and_entries()[1]
             if isinstance(name, str) and name.startswith(_PREFIX))
