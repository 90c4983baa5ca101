"""The attention layers tfpar splits by heads, and what they are made of.

Splitting by heads runs the layer's own `call` once per device with the
local head counts (`spmd/layers._install_heads`). Attention layers are
found by tracing the model (`attention_trace.py`): the projections and
the head counts come from the graph, and `traced_families.TracedFamily` sets the
owner's head-count attributes by the names they carry. This module is the one place of class-specific knowledge,
for what tracing cannot decide:

* `FAMILIES`: classes tfpar knows in full (the attributes holding the
  projections and head counts), those whose key/value heads may be shared
  by devices (rotary keys summed after rotation, `shared_heads.py`), whose
  scores are grouped [batch, key/value heads, groups, query, key] (Gemma),
  or whose totals over heads are not named as the rule expects. Attribute
  names are checked when a model is sharded: if an upgrade of keras-hub
  renamed one, sharding stops with an error naming it.
* `HEAD_BIAS_LAYERS`: sublayers that add a per-head bias computed from the
  scores' shape (Bloom's `AlibiBias`); each device takes its heads' part.

A traced attention tfpar cannot split (a fused kernel not laid out by
heads, a per-head term computed inside the layer, head-count attributes
it cannot tell apart) is a `ValueError` naming the layer, never a silent
replica.
"""

import dataclasses
from typing import Optional, Tuple

import keras

from tfpar._compat import keras_attention
from tfpar._compat import keras_hub_names
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel import traced_families


@dataclasses.dataclass(frozen=True)
class AttentionFamily:
  """How to split one attention class by heads.

  Attributes:
    class_name: the class (or a base class) name.
    module_prefix: where that class lives, e.g. "keras_hub.".
    query, key, value, output: attributes holding the projection layers.
    query_heads: attribute holding the number of query heads.
    key_value_heads: attribute holding the number of key/value heads (None:
      as many as query heads).
    groups: attribute holding query heads per key/value head, if any.
    per_head: attributes that are a total over heads (divided with them
      while a device computes its heads).
    head_local: attributes holding sublayers applied to the heads (query
      and key norms): their gradients are each device's heads' part,
      summed over the tensor group.
  """
  class_name: str
  module_prefix: str
  query: str
  key: str
  value: str
  output: str
  query_heads: str
  key_value_heads: Optional[str] = None
  groups: Optional[str] = None
  per_head: Tuple[str, ...] = ()
  head_local: Tuple[str, ...] = ()

  def projections(self, layer):
    """{role: projection layer}, checked."""
    return {role: _attribute(layer, getattr(self, role), self)
            for role in ("query", "key", "value", "output")}

  def head_local_weights(self, layer):
    """Trainable weights applied to each device's heads.

    Raises:
      ValueError: the layer has trainable weights outside its projections
        and `head_local` (tfpar cannot tell how their gradients add up).
    """
    found = [v for name in self.head_local
             for v in _attribute(layer, name, self).trainable_weights]
    known = {v.path for v in found} | {
        v.path for p in self.projections(layer).values() for v in p.weights}
    for v in layer.trainable_weights:
      if v.path not in known:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) has weight "
            f"{v.path!r} outside its projections, which tfpar's plan for "
            f"{self.class_name} does not place (its head_local). Give the "
            f"layer's weights tfpar.Replicate() or update "
            f"tfpar/tensor_parallel/families.py.")
    return found

  def head_counts(self, layer):
    """(query heads, key/value heads)."""
    query = _attribute(layer, self.query_heads, self)
    if self.key_value_heads is None:
      return query, query
    return query, _attribute(layer, self.key_value_heads, self)

  def local_attributes(self, layer, tensor_size, key_value_local):
    """{attribute: value while one device computes its heads}."""
    query, _ = self.head_counts(layer)
    local = {self.query_heads: query // tensor_size}
    if self.key_value_heads is not None:
      local[self.key_value_heads] = key_value_local
    if self.groups is not None:
      local[self.groups] = (query // tensor_size) // key_value_local
    for name in self.per_head:
      local[name] = _attribute(layer, name, self) // tensor_size
    return local


_MHA_PARTS = keras_attention.PROJECTIONS
_HUB_PARTS = _MHA_PARTS
_HUB_GQA = dict(query_heads="num_query_heads",
                key_value_heads="num_key_value_heads",
                groups="num_key_value_groups")

FAMILIES = (
    # Subclasses of keras.layers.MultiHeadAttention with a call of their own
    # (keras-hub's CachedMultiHeadAttention in GPT-2, BERT's encoder...).
    AttentionFamily("MultiHeadAttention", "keras.", **_MHA_PARTS,
                    query_heads=keras_attention.QUERY_HEADS),
    AttentionFamily("LlamaAttention", "keras_hub.", **_HUB_PARTS, **_HUB_GQA),
    AttentionFamily("QwenAttention", "keras_hub.", **_HUB_PARTS, **_HUB_GQA),
    AttentionFamily("CachedMistralAttention", "keras_hub.", **_HUB_PARTS,
                    **keras_hub_names.MISTRAL_HEADS),
    AttentionFamily("CachedGemmaAttention", "keras_hub.",
                    query="query_dense", key="key_dense", value="value_dense",
                    output="output_dense", **_HUB_GQA,
                    # Its scale is 1/sqrt(hidden_dim // num_query_heads).
                    per_head=("hidden_dim",)),
    AttentionFamily("CachedGemma3Attention", "keras_hub.",
                    query="query_dense", key="key_dense", value="value_dense",
                    output="output_dense", **_HUB_GQA,
                    per_head=("hidden_dim",),
                    head_local=("query_norm", "key_norm")),
)

# Sublayers (class names) whose call adds to the scores a per-head bias
# computed from the scores' shape: `f(scores) = scores + bias(shape)`.
HEAD_BIAS_LAYERS = ("AlibiBias",)

def family_of(layer):
  """The `AttentionFamily` of `layer`, or its `TracedFamily`, or None.

  The layer's class or its nearest registered base class decides, then
  what tracing the model found (`mark_traced`); plain
  `keras.layers.MultiHeadAttention` itself is not a family (tfpar runs it
  with its own head-split call).
  """
  family = table_family_of(layer)
  return family if family is not None else traced_families.marked(layer)


def table_family_of(layer):
  """The `AttentionFamily` of `FAMILIES` for `layer`'s class, or None
  (for plain `keras.layers.MultiHeadAttention` too)."""
  if type(layer) is keras.layers.MultiHeadAttention:
    return None
  for cls in type(layer).__mro__:
    for family in FAMILIES:
      if (cls.__name__ == family.class_name and
          cls.__module__.startswith(family.module_prefix)):
        return family
  return None


# In the source of key/value kernels kept whole because there are fewer
# key/value heads than devices in the tensor group.
SHARED_KEY_VALUE = "key/value head(s) shared"


def key_value_heads_per_device(layer, family, tensor_size):
  """Key/value heads each device computes (1 when they are replicated).

  Raises:
    ValueError: the head counts do not divide over the tensor axis.
  """
  query, key_value = family.head_counts(layer)
  if query % tensor_size:
    raise ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}): {query} query heads "
        f"are not divisible by the mesh's tensor size {tensor_size}, so they "
        f"cannot be split by heads. Choose a tensor size that divides "
        f"{query} or give the layer's weights tfpar.Replicate().")
  if key_value % tensor_size == 0:
    return key_value // tensor_size
  if tensor_size % key_value == 0:
    return 1
  raise ValueError(
      f"Layer {layer.name!r} ({type(layer).__name__}): {key_value} key/value "
      f"heads can be neither split over nor replicated within the mesh's "
      f"tensor size {tensor_size}: one of the two must divide the other.")


def resolved_variables(layer, family, tensor_size, source, project_layout):
  """The `VariableLayout`s of an attention layer split by heads.

  Args:
    layer: the attention layer.
    family: its `AttentionFamily`.
    tensor_size: the mesh's tensor size.
    source: what decided it, for `describe`.
    project_layout: `project_layout(dense, style)` gives a projection's
      `LayerLayout` (from the built-in plans).

  Returns:
    A tuple of `VariableLayout`s for every variable of the layer.
  """
  per_device = key_value_heads_per_device(layer, family, tensor_size)
  _, key_value = family.head_counts(layer)
  shared = per_device == 1 and key_value < tensor_size
  found = []
  parts = family.projections(layer)
  for role, dense in parts.items():
    if role in ("key", "value") and shared:
      found.extend(replicated_layout(
          v, f"built-in: {key_value} {SHARED_KEY_VALUE} by "
             f"{tensor_size // key_value} devices each")
                   for v in dense.weights)
      continue
    style = styles.ROW if role == "output" else styles.COLUMN
    found.extend(project_layout(dense, style).variables)
  claimed = {v.path for v in found}
  found.extend(replicated_layout(v, source) for v in layer.weights
               if v.path not in claimed)
  return tuple(found)


def replicated_layout(variable, source):
  """A replicated `VariableLayout` for `variable`."""
  return layouts.VariableLayout(variable.path, tuple(variable.shape),
                                styles.REPLICATE, None, source)


def _attribute(layer, name, family):
  try:
    return getattr(layer, name)
  except AttributeError:
    try:
      import keras_hub  # pylint: disable=g-import-not-at-top
    except ImportError:
      keras_hub = None
    raise ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) has no attribute "
        f"{name!r}, which tfpar's plan for {family.class_name} relies on "
        f"(written for keras {keras.__version__}, keras-hub 0.32; installed "
        f"keras-hub {getattr(keras_hub, '__version__', '?')}). Give its "
        f"weights tfpar.Replicate() or update "
        f"tfpar/tensor_parallel/families.py.") from None
