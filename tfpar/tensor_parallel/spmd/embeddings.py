"""SPMD calls of vocabulary-split embeddings: Keras's `Embedding` and
keras-hub's `ReversibleEmbedding` (a token embedding and its tied output
head)."""

from keras import ops

from tfpar._compat.keras_modules import backend
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel.spmd import quantized as quantized_lib


def vocab(layer, memo):
  """A vocabulary-split `Embedding`'s call: each device looks up the rows
  it holds (zeros elsewhere) and `g` sums them."""
  tensor_size = memo.groups.tensor_size
  rows = layer.input_dim // tensor_size

  def call(inputs, *args, **kwargs):
    del args, kwargs
    slot = collectives.current_slot()
    index = 0 if slot is None else slot.tensor_index
    if inputs.dtype not in ("int32", "int64"):
      inputs = ops.cast(inputs, "int32")
    local = inputs - index * rows
    inside = ops.logical_and(local >= 0, local < rows)
    if quantized_lib.is_quantized(layer):  # Keras's int8 rows, de-scaled.
      looked_up = type(layer).quantized_call(layer,
                                             ops.where(inside, local, 0))
    else:
      looked_up = ops.take(layer.embeddings, ops.where(inside, local, 0),
                           axis=0)
    # Partial rows cross in the compute dtype: exact, one is not zero.
    looked_up = ops.cast(looked_up, layer.compute_dtype)
    looked_up = looked_up * ops.cast(inside, looked_up.dtype)[..., None]
    return memo.g(looked_up, layer.name)
  return call


def _lookup_mask(layer, inputs, outputs):
  """A ReversibleEmbedding's `mask_zero` mask, as its own call sets it."""
  if getattr(layer, "mask_zero", False):
    backend.set_keras_mask(outputs, ops.not_equal(inputs, 0))
  return outputs


def reversible(layer, memo):
  """A vocabulary-split `ReversibleEmbedding` (keras-hub's token embedding
  and its tied output head): forward as `vocab`; reversed, each device
  takes the logits of its rows (`f` on the hidden input: its gradient is a
  partial sum over the vocabulary) and the group all-gathers them."""
  lookup = vocab(layer, memo)

  def call(inputs, reverse=False):
    if not reverse:
      return _lookup_mask(layer, inputs, lookup(inputs))
    if quantized_lib.is_quantized(layer):
      # Keras's int8 logits of this device's rows (its soft cap is
      # elementwise), gathered.
      logits = type(layer).quantized_call(
          layer, memo.f(inputs, layer.name), reverse=True)
      return collectives.gather(memo.groups, logits, -1, layer.name)
    kernel = (ops.transpose(layer.embeddings) if layer.tie_weights else
              layer.reverse_embeddings)
    if layer.reverse_dtype is None and memo.wide(layer):
      x = memo.f_wide(inputs, layer.name)
      if kernel.dtype == layer.compute_dtype:
        logits = ops.cast(rounding.widened_product(x, kernel),
                          layer.compute_dtype)
      else:  # Keras's Embedding does not autocast: a float32 product.
        logits = ops.matmul(x, ops.cast(kernel, x.dtype))
    else:
      x = memo.f(inputs, layer.name)
      if layer.reverse_dtype is not None:
        x = ops.cast(x, layer.reverse_dtype)
        kernel = ops.cast(kernel, layer.reverse_dtype)
      logits = ops.matmul(x, kernel)
    logits = collectives.gather(memo.groups, logits, -1, layer.name)
    if layer.logit_soft_cap is not None:
      cap = layer.logit_soft_cap
      logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
    return logits
  return call
