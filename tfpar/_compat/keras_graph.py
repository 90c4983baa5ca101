"""A Functional graph with its nested Functional models inlined.

keras-hub task models (`CausalLM`, `TextClassifier`, `MaskedLM`) call their
backbone, itself a Functional model, as one layer: `backbone(inputs)` then
the head. A pipeline that cuts the outer graph sees the whole backbone as
one node. `inlined(graph)` rebuilds the outer graph with each such call
replaced by the calls of the nested model's own layers: the same layer
objects (the same weights, no copies), new graph nodes (Keras `Node`s, as
`keras.Model(intermediate inputs, ...)` adds when it clones a graph), no
layer traced again.

A nested model is inlined when calling its graph's layers one after the
other is exactly what its `call` does: a stock `Functional` (keras-hub
backbones) or `Sequential` whose `call` is Keras's own, called with one
input structure its inputs match (same structure, dtypes and ranks: no
casting or reshaping that Keras's call would add), no mask and no
`training` fixed at the call. Any other nested model stays one node, and
so do all of them when a nested layer shares its name with another layer
of the flat graph (Keras refuses the flat model; a warning says so).
"""

import warnings

import keras
from keras.src.models import functional as functional_module
from keras.src.ops import node as node_module

from tfpar._compat import keras_layers
from tfpar._compat.checks import require

_PURPOSE = "cutting a pipeline inside a nested Functional model"
_Node = require(node_module, "Node", _PURPOSE)
_Functional = require(functional_module, "Functional", _PURPOSE)
_STOCK_CALLS = (require(_Functional, "call", _PURPOSE),
                require(keras.Sequential, "call", _PURPOSE))


def _structures(graph):
  return (require(graph, "_inputs_struct", _PURPOSE),
          require(graph, "_outputs_struct", _PURPOSE))


def _nested_graph(operation):
  """The graph of a nested model whose call only runs that graph, or None."""
  if not isinstance(operation, keras.Model):
    return None
  if type(operation).call not in _STOCK_CALLS:
    return None
  return keras_layers.functional_graph(operation)


def _all_none(value):
  return all(leaf is None for leaf in keras.tree.flatten(value))


def _inner_inputs(graph, node):
  """The outer tensors `node` (a call of `graph`'s model) feeds each of
  the nested graph's inputs, in its flat input order; None when the call
  does more than run the graph."""
  args, kwargs = node.arguments.args, dict(node.arguments.kwargs)
  if not _all_none(kwargs.pop("training", None)) or not _all_none(
      kwargs.pop("mask", None)):
    return None
  if "inputs" in kwargs:
    args = args + (kwargs.pop("inputs"),)
  if kwargs or len(args) != 1:
    return None
  inputs_struct = _structures(graph)[0]
  value = args[0]
  if (isinstance(inputs_struct, list) and len(inputs_struct) == 1 and
      isinstance(value, keras.KerasTensor)):
    value = [value]
  try:
    keras.tree.assert_same_structure(
        keras.tree.lists_to_tuples(value),
        keras.tree.lists_to_tuples(inputs_struct))
  except (ValueError, TypeError):
    return None
  outer = keras.tree.flatten(value)
  inner = keras.tree.flatten(inputs_struct)
  for given, expected in zip(outer, inner):
    if (not isinstance(given, keras.KerasTensor) or
        given.dtype != expected.dtype or
        len(given.shape) != len(expected.shape)):
      return None
  return list(zip(inner, outer))


def _copy(tensor):
  return keras.KerasTensor(tensor.shape, dtype=tensor.dtype,
                           sparse=tensor.sparse, ragged=tensor.ragged,
                           name=f"{tensor.name}_inlined")


def _walk(graph, tensors, inlined):
  """Maps every tensor of `graph` to its flat graph's tensor in `tensors`
  ({id(original): flat tensor}; absent: unchanged), recursing into nested
  models and recording their names in `inlined`."""
  for node in keras_layers.ordered_nodes(graph):
    operation = node.operation
    nested = _nested_graph(operation)
    pairs = _inner_inputs(nested, node) if nested is not None else None
    if pairs is not None:
      for inner, outer in pairs:
        tensors[id(inner)] = tensors.get(id(outer), outer)
      _walk(nested, tensors, inlined)
      inner_outputs = keras.tree.flatten(_structures(nested)[1])
      for outer, inner in zip(node.outputs, inner_outputs):
        tensors[id(outer)] = tensors.get(id(inner), inner)
      inlined.append(operation.name)
      continue
    if not any(id(t) in tensors and tensors[id(t)] is not t
               for t in node.input_tensors):
      continue  # Fed by the original tensors: the original node stands.
    lookup = {id(t): tensors.get(id(t), t) for t in node.input_tensors}
    args, kwargs = node.arguments.fill_in(lookup)
    outputs = [_copy(t) for t in node.outputs]
    _Node(operation, call_args=args, call_kwargs=kwargs, outputs=outputs)
    tensors.update((id(t), new) for t, new in zip(node.outputs, outputs))


def inlined(graph, name):
  """`graph` (a Functional graph) with its nested models' calls replaced
  by their layers' calls.

  Args:
    graph: the Functional graph of a model (`keras_layers.functional_graph`).
    name: the name of the flat model.

  Returns:
    (flat graph, names of the inlined models): a `keras.Model` over the
    same inputs and layers, or `graph` itself and () when nothing nested
    could be inlined.
  """
  if not any(_nested_graph(n.operation) is not None
             for n in keras_layers.ordered_nodes(graph)):
    return graph, ()
  tensors, names = {}, []
  _walk(graph, tensors, names)
  if not names:
    return graph, ()
  inputs_struct, outputs_struct = _structures(graph)
  outputs = keras.tree.map_structure(lambda t: tensors.get(id(t), t),
                                     outputs_struct)
  try:
    return keras.Model(inputs_struct, outputs, name=name), tuple(names)
  except ValueError as error:  # Two layers of one name (outer and nested).
    warnings.warn(
        f"Nested model(s) {', '.join(names)} cannot be inlined into "
        f"{graph.name!r}, so each stays one pipeline node that no stage "
        f"boundary can enter: {error}", stacklevel=3)
    return graph, ()
