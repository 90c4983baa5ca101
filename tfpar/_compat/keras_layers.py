"""Private state of Keras layers, models and variables.

Keras has no public way to list a layer's own variables in creation order
as mutable lists (tensor parallelism and ZeRO swap a weight for its shards
in place, so checkpoints and `model.weights` keep their order), to walk
every nested layer including a model's own, to replace the storage of a
`keras.Variable` (weights created spread, moved to a pipeline stage), to
read a Functional model's graph by depth (pipeline cuts, the planner), or
to run a Functional model's graph with a wrapped layer call (sequence
parallelism). Each accessor checks what it reads.
"""

import keras

from tfpar._compat import keras_modules
from tfpar._compat.checks import require

for _name in ("_flatten_layers", "_track_trackable"):
  require(keras.layers.Layer, _name, "walking and tracking layers")
require(keras.Variable, "_initialize", "replacing a weight's storage")
require(keras.Variable, "_maybe_autocast", "reading a weight in a layer")


def flatten_layers(layer, include_self=True, recursive=True):
  """Every layer nested in `layer` (itself first when `include_self`)."""
  return layer._flatten_layers(  # pylint: disable=protected-access
      include_self=include_self, recursive=recursive)


def variable_lists(layer):
  """A layer's own (trainable, non-trainable) variable lists, the mutable
  lists Keras keeps in creation order."""
  return (require(layer, "_trainable_variables", "a layer's own weights"),
          require(layer, "_non_trainable_variables", "a layer's own weights"))


def own_variables(layer):
  """A layer's own variables (not its sublayers'), trainable first."""
  trainable, non_trainable = variable_lists(layer)
  return list(trainable) + list(non_trainable)


def track(owner, value, name):
  """Makes `owner` track `value` as its attribute `name` in checkpoints.

  Keras's own tracking is off meanwhile: on a built layer it refuses new
  variables, and it would list a variable among the layer's weights again.
  """
  with require(keras_modules.keras_tracking, "DotNotTrackScope",
               "tracking a replaced weight for checkpoints")():
    owner._track_trackable(value, name=name, overwrite=True)  # pylint: disable=protected-access


def own_losses(layer):
  """The mutable list of the losses `layer`'s own calls added
  (`add_loss`, activity regularizers) since Keras last cleared it."""
  losses = require(layer, "_losses", "the losses a layer's call adds")
  if not isinstance(losses, list):
    raise ImportError(
        f"tfpar reads Keras's Layer._losses as a list; this Keras keeps a "
        f"{type(losses).__name__}: tfpar needs updating for it.")
  return losses


def storage_trainable(variable):
  """Whether the TensorFlow variable behind a `keras.Variable` is
  trainable: fixed when it was created, while Keras's flag follows
  `layer.trainable`. A TensorFlow gradient tape records only reads of
  trainable variables, so a variable replaced while its layer is frozen
  must keep the old storage's flag, or unfreezing the layer later trains
  it on one device and leaves it unchanged here."""
  return bool(getattr(storage(variable, variable), "trainable", True))


def seed_generators(layer):
  """A layer's own seed generators (dropout's), or an empty list."""
  return getattr(layer, "_seed_generators", None) or []


def storage(variable, default=None):
  """The TensorFlow variable behind a `keras.Variable`, or `default` for
  anything else."""
  return getattr(variable, "_value", default)


def autocast(variable, value):
  """`value` cast as `variable` is read inside a layer under a mixed
  precision policy (its autocast scope)."""
  return variable._maybe_autocast(value)  # pylint: disable=protected-access


def can_replace_storage(variable):
  """Whether `variable` is a Keras variable whose storage tfpar can set."""
  return hasattr(variable, "_value") and hasattr(variable, "_initialize")


def replace_storage(variable, value):
  """Makes a `keras.Variable` read and write `value` (a TensorFlow
  variable, or another Keras variable's storage)."""
  variable._value = value  # pylint: disable=protected-access


def set_path(variable, path):
  """Renames a `keras.Variable`'s path (its checkpoint key)."""
  require(variable, "_path", "a weight's path")
  variable._path = path  # pylint: disable=protected-access


def dense_kernel(layer):
  """A Dense or EinsumDense layer's kernel variable (before any LoRA or
  quantization wrapping)."""
  return require(layer, "_kernel", "a projection's kernel")


def embeddings(layer):
  """An Embedding layer's table variable."""
  return require(layer, "_embeddings", "an embedding's table")


def functional_graph(model):
  """The Functional graph behind a Sequential or Functional model, or None
  (a Sequential without an input shape, a subclassed model)."""
  graph = getattr(model, "_functional", None)
  if graph is not None:
    return graph
  return model if hasattr(model, "_nodes_by_depth") else None


def ordered_nodes(graph):
  """A Functional graph's layer calls (not its inputs), in an order that
  computes every tensor before it is used."""
  by_depth = require(graph, "_nodes_by_depth", "a model's graph")
  nodes = []
  for depth in sorted(by_depth, reverse=True):
    nodes.extend(n for n in by_depth[depth] if not n.is_input)
  return nodes


def wrap_graph_calls(model, wrap):
  """Makes a Functional (or Sequential) model run each operation of its
  graph through `wrap(operation, call)`, which returns the call to make.
  Returns False when the model has no graph to run."""
  graph_model = functional_graph(model) or model
  original = getattr(graph_model, "_run_through_graph", None)
  if original is None:
    return False

  def run_through_graph(inputs, operation_fn=lambda op: op, call_fn=None):
    return original(inputs, lambda operation: wrap(
        operation, operation_fn(operation)), call_fn)

  object.__setattr__(graph_model, "_run_through_graph", run_through_graph)
  return True


require(keras.Variable, "_direct_assign", "assigning whole weights")


class WholeAssignment:
  """Mixin for a Keras variable class whose `assign` (and checkpoint restores)
  go to `self.assign_whole(value)`, which the class defines: ZeRO-3 weights
  held as slices take a whole value and keep their own slice of it."""

  def _direct_assign(self, value):
    self.assign_whole(value)
