"""Resolving the attention layers tracing finds (`attention_trace.py`):
split by heads as the families of `families.py` are, or refused."""

import keras

from tfpar._compat import keras_layers
from tfpar.tensor_parallel import attention_trace
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import regions
from tfpar.tensor_parallel import structure
from tfpar.tensor_parallel import traced_families


def resolve(model, projections, embeddings, handled, user, tensor_size,
            resolve_attention):
  """The attention layers tracing finds, resolved.

  Args:
    model: the built model.
    projections: its Dense / EinsumDense layers outside known attention.
    embeddings: its embedding layers (recorded by the same trace).
    handled: layers already resolved (known attention and theirs).
    user: {path: (style, source)} of the plan's rules; an attention whose
      projections a rule names is left to the rules.
    tensor_size: the mesh's tensor size.
    resolve_attention: `builtin._resolve_attention`.

  Returns:
    (their `LayerLayout`s, the projections left, the trace
    (`structure.trace_calls`)).

  Raises:
    ValueError: an attention that cannot be split by heads.
  """
  containers = {}
  for layer in keras_layers.flatten_layers(model, include_self=False,
                                           recursive=True):
    if isinstance(layer, keras.Model) or layer in handled:
      continue
    inner = list(keras_layers.flatten_layers(layer, include_self=False))
    if sum(1 for x in inner if any(x is p for p in projections)) >= 2:
      containers[layer] = inner
  biases = [x for inner in containers.values() for x in inner
            if type(x).__name__ in families.HEAD_BIAS_LAYERS]
  weighted = [x for inner in containers.values() for x in inner
              if keras_layers.own_variables(x) and x not in projections]
  calls = structure.trace_calls(model, projections + list(containers) +
                                biases + embeddings + weighted)
  found = attention_trace.find(
      calls, projections, containers,
      [regions.key(calls[b][2]) for b in biases
       if b in calls])
  resolved, taken = [], set()
  for attention in found:
    parts = list(attention.projections.values())
    if any(v.path in user for p in parts for v in p.weights):
      continue  # The rules decide, projection by projection.
    owner = attention.owner
    attention.head_local = _head_local(owner, parts, calls)
    family = traced_families.traced_family(owner, attention)
    _check(owner, family, tensor_size)
    traced_families.mark_traced(owner, family)
    resolved.extend(resolve_attention(owner, family, user, tensor_size,
                                      True))
    taken.update(id(p) for p in parts)
  return resolved, [p for p in projections if id(p) not in taken], calls


def _check(layer, family, tensor_size):
  """Refuses what a traced attention cannot run split by heads."""
  query, key_value = family.head_counts(layer)
  for sub in keras_layers.flatten_layers(layer, include_self=False):
    if isinstance(sub, keras.layers.Dropout) and sub.rate:
      raise ValueError(
          f"Tensor parallelism cannot split layer {layer.name!r} "
          f"({type(layer).__name__}) by heads with its dropout sublayer "
          f"{sub.name!r} (rate={sub.rate!r}): tfpar draws one device's "
          f"mask only for the attention dropout of the classes in "
          f"tfpar/tensor_parallel/families.py. Use rate 0 there.")
  if key_value % tensor_size and query % tensor_size == 0:
    raise ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}): {key_value} "
        f"key/value heads are not divisible by the mesh's tensor size "
        f"{tensor_size}; devices share key/value heads only for the "
        f"classes in tfpar/tensor_parallel/families.py. Choose a tensor "
        f"size that divides {key_value} or give the layer's weights "
        f"tfpar.Replicate().")


def _head_local(owner, parts, calls):
  """The owner's sublayers with trainable weights (outside its
  projections) whose input comes from the projections: applied to each
  device's heads, their gradients partial.

  Raises:
    ValueError: a trainable weight whose use the trace does not show.
  """
  inside = {id(x) for p in parts
            for x in keras_layers.flatten_layers(p, include_self=True)}
  found = []
  for sub in keras_layers.flatten_layers(owner, include_self=True):
    own = [v for v in keras_layers.own_variables(sub) if v.trainable]
    if id(sub) in inside or not own:
      continue
    if sub is owner or sub not in calls:
      raise ValueError(
          f"Layer {owner.name!r} ({type(owner).__name__}) computes "
          f"attention (found by tracing) with weight {own[0].path!r}, "
          f"which tracing cannot place before or after the projections, "
          f"so tfpar cannot tell whether each device's gradient of it is "
          f"whole or its heads' part. Give the layer's weights "
          f"tfpar.Replicate() rules, or add its class to "
          f"tfpar/tensor_parallel/families.py's FAMILIES.")
    if attention_trace.reads_projections(calls[sub], parts, calls):
      found.append(sub)
  return tuple(found)
