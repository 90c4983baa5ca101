"""Private parts of `keras.layers.MultiHeadAttention`.

Tensor parallelism splits a stock `MultiHeadAttention` by heads: it runs
the layer's own projections (`_query_dense`...) and attention step
(`_compute_attention`, after `_compute_attention_mask`) once per device on
that device's heads. Keras exposes none of them publicly. The names are
checked at import (`Incompatible` if one moved).
"""

import inspect

import keras

from tfpar._compat.checks import require

_MHA = keras.layers.MultiHeadAttention
for _name in ("_compute_attention", "_compute_attention_mask"):
  require(_MHA, _name, "splitting MultiHeadAttention by heads")

# Keras >= 3.13 lets _compute_attention apply a plain causal mask itself.
COMPUTES_CAUSAL_MASK = "use_causal_mask" in inspect.signature(
    _MHA._compute_attention).parameters  # pylint: disable=protected-access

# The attributes of a MultiHeadAttention holding its projections and head
# count (keras-hub subclasses share them).
PROJECTIONS = dict(query="_query_dense", key="_key_dense",
                   value="_value_dense", output="_output_dense")
QUERY_HEADS = "_num_heads"
# Its attention-score Dropout and the axes attention runs over (the scores
# are [batch..., heads, target..., source...]), built with the layer.
DROPOUT = "_dropout_layer"
ATTENTION_AXES = "_attention_axes"


def projections(layer):
  """{role: EinsumDense} of a built MultiHeadAttention (with "gate" when
  the layer is gated)."""
  parts = {role: require(layer, name, "attention projections")
           for role, name in PROJECTIONS.items()}
  gate = getattr(layer, "_gate_dense", None)
  if gate is not None:
    parts["gate"] = gate
  return parts


def computes_plain_causal_mask(layer):
  """Whether `layer._compute_attention` itself applies a causal mask (the
  stock one, without a sliding window)."""
  return (COMPUTES_CAUSAL_MASK and
          getattr(layer, "_sliding_window", None) is None and
          type(layer)._compute_attention is _MHA._compute_attention)  # pylint: disable=protected-access


def compute_attention_mask(layer, query, value, **kwargs):
  """The layer's combined attention mask (Keras's own computation)."""
  return layer._compute_attention_mask(query, value, **kwargs)  # pylint: disable=protected-access


def compute_attention(layer, *args, **kwargs):
  """The layer's attention step on projected query, key and value."""
  return layer._compute_attention(*args, **kwargs)  # pylint: disable=protected-access
