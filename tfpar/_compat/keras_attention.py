"""Private parts of `keras.layers.MultiHeadAttention`.

Tensor parallelism splits a stock `MultiHeadAttention` by heads through
its projections (`_query_dense`...) and head count, and draws its
attention dropout (`_dropout_layer`, over `_attention_axes`) as one device
would. Keras exposes none of them publicly; each is read through
`require` (`Incompatible` if one moved).
"""

from tfpar._compat.checks import require

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

