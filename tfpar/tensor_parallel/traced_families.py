"""Attention layers found by tracing (`attention_trace.py`), run split by
heads with their own call.

Tracing gives the projections and the head counts; the owner's call reads
its head counts from attributes, which `traced_family` finds by the names
they carry: counts of heads (`num_heads`, `num_query_heads`,
`num_key_value_heads`, `n_head`...: names ending in "heads", each equal
to the query or the key/value heads tracing found), query heads per
key/value head (names ending in "groups") and totals over heads (names
with "hidden" equal to heads x head size, e.g. GPT-NeoX's `hidden_dim`
its output is reshaped to). While a device computes its heads they hold
its share. An attribute named like a head count that holds another
number is a `ValueError`: tfpar cannot tell what it counts.
"""

import dataclasses
import re

# A traced attention's owner: int attributes named like these hold...
_HEADS = re.compile(r"^_*(n_head|num_head|(\w+_)?heads)$")  # head counts
_GROUPS = re.compile(r"^_*\w*groups$")  # query heads per key/value head
_TOTALS = re.compile(r"^_*\w*hidden\w*$")  # a total over heads (if equal)


@dataclasses.dataclass(frozen=True)
class TracedFamily:
  """An attention found by tracing (`attention_trace.Attention`), with
  the interface of `AttentionFamily`.

  Attributes:
    class_name: the owner's class name.
    found: the `attention_trace.Attention`.
    local_names: {attribute: "query", "key_value", "groups" or "total"}.
  """
  class_name: str
  found: object
  local_names: tuple

  def projections(self, layer):
    del layer
    return dict(self.found.projections)

  def head_counts(self, layer):
    del layer
    return self.found.query_heads, self.found.key_value_heads

  def head_local_weights(self, layer):
    """Trainable weights applied to each device's heads (partial
    gradients)."""
    del layer
    return [v for sub in self.found.head_local for v in sub.trainable_weights]

  def local_attributes(self, layer, tensor_size, key_value_local):
    query_local = self.found.query_heads // tensor_size
    values = {"query": query_local, "key_value": key_value_local,
              "groups": query_local // key_value_local}
    local = {}
    for name, kind in self.local_names:
      local[name] = (getattr(layer, name) // tensor_size if kind == "total"
                     else values[kind])
    return local


def traced_family(layer, found):
  """The `TracedFamily` of `found` on its owner `layer`.

  Raises:
    ValueError: the attention cannot be split by heads (`found.problem`),
      or an attribute named like a head count holds another number.
  """
  query, key_value = found.query_heads, found.key_value_heads
  where = f"Layer {layer.name!r} ({type(layer).__name__})"
  advice = (f"Give its weights tfpar.Replicate() rules, or add its class "
            f"to tfpar/tensor_parallel/families.py's FAMILIES.")
  if found.problem:
    raise ValueError(f"{where} computes attention (found by tracing), "
                     f"but tfpar cannot split it by heads: {found.problem}. "
                     f"{advice}")
  names = []
  for name, value in sorted(vars(layer).items()):
    if not isinstance(value, int) or isinstance(value, bool):
      continue
    if _HEADS.match(name):
      if value == query:
        names.append((name, "query"))
      elif value == key_value:
        names.append((name, "key_value"))
      else:
        raise ValueError(
            f"{where}: its attribute {name!r} = {value} looks like a head "
            f"count, but tracing found {query} query and {key_value} "
            f"key/value heads, so tfpar cannot tell what it counts. "
            f"{advice}")
    elif _GROUPS.match(name) and key_value and value == query // key_value:
      names.append((name, "groups"))
    elif _TOTALS.match(name) and value == query * found.head_dim:
      names.append((name, "total"))
  if not any(kind == "query" for _, kind in names):
    raise ValueError(
        f"{where} computes attention with {query} heads (found by "
        f"tracing), but none of its attributes is named like a head count "
        f"(num_heads, num_query_heads...), so tfpar cannot run its call on "
        f"one device's heads. {advice}")
  return TracedFamily(type(layer).__name__, found, tuple(names))


_TRACED = "_tfpar_traced_attention"


def mark_traced(layer, family):
  """Records `family` (a `TracedFamily`) as `layer`'s, for
  `families.family_of`."""
  object.__setattr__(layer, _TRACED, family)


def marked(layer):
  """The `TracedFamily` `mark_traced` recorded on `layer`, or None."""
  return getattr(layer, _TRACED, None)
