"""Finding a model's MLPs by tracing it, in functional and subclassed code.

A column-parallel projection pays off when its output reaches a
row-parallel projection through elementwise ops only (Megatron's MLP):
`Dense(gelu) -> Dense`, or a gated MLP written inline in a subclassed
block, `down(silu(gate(x)) * up(x))`. Which projections those are is not
visible from the layer objects of a subclassed model, so `mlp_styles`
traces the model once (a throw-away `tf.function` trace, nothing runs),
records each projection's input and output tensors, and looks for the
elementwise regions (`regions.find`) between them.
"""

import contextlib

import tensorflow as tf

from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import regions
from tfpar.tensor_parallel import styles


def _input_specs(model):
  """TensorSpecs in the structure `model` is called with, or None."""
  try:
    inputs = model.input
  except (AttributeError, ValueError):  # A Sequential model: its inputs.
    inputs = getattr(model, "inputs", None)
    if not inputs:
      return None
    inputs = inputs[0] if len(inputs) == 1 else inputs
  return tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)


def _known(spec):
  return tf.TensorSpec([2 if d is None else d for d in spec.shape],
                       spec.dtype)


class _Calls(dict):
  """`trace_calls`'s records; `repeated` holds the layers called more than
  once (only their last call is recorded)."""

  def __init__(self):
    super().__init__()
    self.repeated = set()


# {id(model): None, or ({layer: None} of the layers recorded, their
# `_Calls`)} of the models inside `shared_trace`.
_shared = {}


@contextlib.contextmanager
def shared_trace(model):
  """Within it, `trace_calls` of `model` traces it once for every caller
  (the plan, the MLP pairing, the pipeline's pairs): a call asking for
  layers the last trace did not record traces again with both sets. Only
  while nothing changes the model's layers (before they are split)."""
  outer = id(model) in _shared
  _shared.setdefault(id(model), None)
  try:
    yield
  finally:
    if not outer:
      _shared.pop(id(model), None)


def trace_calls(model, layers):
  """{layer: (args, kwargs, output)} of `layers` from one symbolic call of
  `model` (a throw-away `tf.function` trace; nothing runs), plus the
  flattened input tensors under the key None. Empty when the model's
  inputs are not known. Inside `shared_trace(model)` the records may
  hold more layers than asked for."""
  layers = list(dict.fromkeys(layers))
  if id(model) not in _shared:
    return _trace_calls(model, layers)
  last = _shared[id(model)]
  if last is not None:
    if all(layer in last[0] for layer in layers):
      return last[1]
    layers = list(dict.fromkeys(list(last[0]) + layers))
  records = _trace_calls(model, layers)
  _shared[id(model)] = (dict.fromkeys(layers), records)  # Keeps the order.
  return records


def _trace_calls(model, layers):
  specs = _input_specs(model)
  if specs is None:
    return {}
  records = _Calls()

  def recording(layer, original):
    def call(*args, **kwargs):
      output = original(*args, **kwargs)
      if layer in records:
        records.repeated.add(layer)
      records[layer] = (args, kwargs, output)
      return output
    return call

  # Keras calls a quantized layer's `quantized_call` instead of `call`.
  method = lambda layer: ("quantized_call" if getattr(
      layer, "quantization_mode", None) else "call")
  patched = [layer for layer in dict.fromkeys(layers)
             if method(layer) not in vars(layer)]
  for layer in patched:
    object.__setattr__(layer, method(layer), recording(
        layer, getattr(layer, method(layer))))

  def run(x):
    records[None] = ((), {}, tf.nest.flatten(x))
    return model(x, training=False)

  try:
    try:
      tf.function(run, autograph=False).get_concrete_function(specs)
    except Exception:  # pylint: disable=broad-except
      # A layer branching in Python on a size (Qwen3.5's gated delta layer
      # pads the sequence to a multiple of its chunk) traces only with
      # known sizes: once more with every unknown dimension 2.
      records.clear()
      records.repeated.clear()
      tf.function(run, autograph=False).get_concrete_function(
          tf.nest.map_structure(_known, specs))
  except Exception as error:  # pylint: disable=broad-except
    raise ValueError(
        f"Tensor parallelism's built-in plan traces model {model.name!r} "
        f"once to find its attention and MLPs, and that trace failed "
        f"({type(error).__name__}: {str(error)[:300]}). Give the model "
        f"rules with the built-in plans off, "
        f"tfpar.ShardingPlan([...], builtin=False).") from error
  finally:
    for layer in patched:
      object.__delattr__(layer, method(layer))
  return records


def _trace(model, candidates, calls=None):
  """{layer: (input tensor, output tensor)} from one symbolic call (or
  from `calls`, a `trace_calls` result)."""
  if calls is None:
    calls = trace_calls(model, candidates)
  found = {}
  for layer in candidates:
    if layer in calls:
      args, kwargs, output = calls[layer]
      found[layer] = (args[0] if args else kwargs.get("inputs"), output)
  return found


def mlp_styles(model, candidates, calls=None):
  """{projection layer: COLUMN or ROW} for the model's MLPs.

  Args:
    model: a built Keras model with known inputs (functional, Sequential
      or a keras-hub backbone); other models get no MLPs.
    candidates: the Dense and EinsumDense layers that may be split.
    calls: a `trace_calls` result covering `candidates` (default: traced
      here).

  Returns:
    A dict; each ROW layer's input is computed, through elementwise ops
    only, from the outputs of COLUMN layers (with elementwise activations)
    split along the same axis.
  """
  if calls is None:
    calls = trace_calls(model, candidates)
  # A projection called more than once (Gemma3n's AltUp router, once per
  # prediction and once per correction) pairs with its last call's
  # consumers only: its other calls' outputs would reach unsplit layers.
  repeated = getattr(calls, "repeated", ())
  records = {layer: found for layer, found in
             _trace(model, candidates, calls).items()
             if layer not in repeated}
  columns = {}
  for layer, (_, output) in records.items():
    axis = layouts.activation_split_axis(layer, styles.COLUMN)
    if (tf.is_tensor(output) and axis is not None and
        regions.is_elementwise(layer.activation)):
      columns[regions.key(output)] = (layer, axis)
  found = {}
  for row in candidates:
    if row not in records or row in found:
      continue
    axis = layouts.activation_split_axis(row, styles.ROW)
    if axis is None:
      continue

    def source_of(tensor, axis=axis, row=row):
      layer, column_axis = columns.get(regions.key(tensor), (None, None))
      if layer is None or layer is row or column_axis != axis or (
          found.get(layer, styles.COLUMN) != styles.COLUMN):
        return None
      return layer

    region = regions.find(records[row][0], source_of, axis)
    if region is None:
      continue
    found[row] = styles.ROW
    for layer in region.sources.values():
      found[layer] = styles.COLUMN
  return found


def reads_model_inputs(calls, layer):
  """Whether `layer`'s traced input is computed from the model's inputs
  (False for a position table's ids, `arange` constants), or None when
  the trace did not record it."""
  if layer not in calls or None not in calls:
    return None
  args, kwargs, _ = calls[layer]
  x = args[0] if args else kwargs.get("inputs")
  if not hasattr(x, "op"):  # An eager constant captured by the trace.
    return False
  model_inputs = {regions.key(t) for t in calls[None][2] if hasattr(t, "op")}
  seen, stack = set(), [x]
  while stack:
    t = stack.pop()
    if regions.key(t) in model_inputs:
      return True
    if regions.key(t) in seen:
      continue
    seen.add(regions.key(t))
    stack.extend(t.op.inputs)
  return False
