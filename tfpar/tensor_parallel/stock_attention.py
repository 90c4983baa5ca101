"""`keras.layers.MultiHeadAttention` split by heads (the head design).

tfpar runs its own copy of the layer's `call`, with the projections and
the attention of each head shard on its own device and the output
projection's partial sums combined over the tensor group. keras-hub's
attention layers, which have calls of their own, are replayed instead
(`heads.py`).
"""

import keras

from tfpar._compat import keras_attention
from tfpar._compat.keras_modules import backend
from tfpar.tensor_parallel import builtin
from tfpar.tensor_parallel import comm
from tfpar.tensor_parallel import compute
from tfpar.tensor_parallel import layers as layers_lib


def multi_head_attention(layout, group, sequence_parallel, float32_sums):
  """The tensor-parallel `call` of a `keras.layers.MultiHeadAttention`."""
  # Mirrors keras.layers.MultiHeadAttention.call, with the projections and
  # the attention of each head shard on its own device.
  layer = layout.layer
  parts = builtin.attention_parts(layer)

  def call(query, value, key=None, query_mask=None, value_mask=None,
           key_mask=None, attention_mask=None, return_attention_scores=False,
           training=None, use_causal_mask=False):
    if key is None:
      key = value
    query_mask = backend.get_keras_mask(query)
    for tensor in (query, value, key):
      backend.set_keras_mask(tensor, None)
    # Keras >= 3.13 lets _compute_attention apply a plain causal mask
    # itself (and has sliding windows); older Keras always needs the mask.
    causal_only = (
        use_causal_mask and query_mask is None and value_mask is None and
        key_mask is None and attention_mask is None and
        keras_attention.computes_plain_causal_mask(layer))
    if causal_only:
      attention_mask = None
    else:
      attention_mask = keras_attention.compute_attention_mask(
          layer, query, value, query_mask=query_mask, value_mask=value_mask,
          key_mask=key_mask, attention_mask=attention_mask,
          use_causal_mask=use_causal_mask)
    extra = {"use_causal_mask": True} if causal_only else {}
    devices = group()
    name = layer.name
    copies = {}
    for tensor in (query, key, value):
      if id(tensor) not in copies:
        copies[id(tensor)] = layers_lib.spread(tensor, devices, name,
                                               float32_sums)
    inputs = [copies[id(query)], copies[id(key)], copies[id(value)]]
    if attention_mask is not None:
      inputs.append(comm.broadcast(attention_mask, devices, name))

    outs, scores = [], []
    for index, device in enumerate(devices):
      def shard_fn(q, k, v, mask=None, index=index):
        projected = {
            role: layers_lib.project(parts[role], x, index,
                                     parts[role].equation,
                                     float32=float32_sums)
            for role, x in (("query", q), ("key", k), ("value", v))}
        output, attention_scores = keras_attention.compute_attention(
            layer, projected["query"], projected["key"], projected["value"],
            mask,
            training, return_attention_scores, **extra)
        if "gate" in parts:
          gate = layers_lib.project(parts["gate"], q, index,
                                    parts["gate"].equation,
                                    float32=float32_sums)
          output = keras.ops.multiply(output,
                                      parts["gate"].activation(gate))
        output = layers_lib.project(parts["output"], output, index,
                                    parts["output"].equation, partial=True,
                                    float32=float32_sums)
        if return_attention_scores:
          return output, attention_scores
        return output
      result = compute.on_device(device, shard_fn,
                                 *[x[index] for x in inputs])
      if return_attention_scores:
        outs.append(result[0])
        scores.append(result[1])
      else:
        outs.append(result)
    output = layers_lib.combine(outs, devices, name,
                                layers_lib.finisher(parts["output"]),
                                sequence_parallel)
    if query_mask is not None:
      backend.set_keras_mask(output, query_mask)
    if return_attention_scores:
      return output, comm.gather(scores, 1, devices, name)
    return output
  return call
