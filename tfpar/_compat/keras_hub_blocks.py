"""keras-hub's transformer blocks as sequence parallelism sees them.

Under `TensorParallelStrategy(sequence_parallel=True)` a
keras-hub block runs its own `call` on each device's slice of the sequence
(`tensor_parallel/spmd/blocks.py`). Everything in it is position-wise but
attention, which gathers the sequence, and the attention mask, which the
block computes from its input's shape: the private method that does so is
named here and wrapped (checked with `require`, so an upgrade that renames
it fails with `Incompatible`) to see a stand-in of the whole sequence.
"""

from tfpar._compat.checks import require

# Block class -> (its attention-mask method, the argument holding the
# sequence it reads the length of). None: the mask does not depend on the
# length (BERT's encoder merges the padding mask only).
BLOCK_MASKS = {
    "TransformerDecoder": ("_compute_self_attention_mask",
                           "decoder_sequence"),  # GPT-2
    "TransformerEncoder": None,  # BERT
    "LlamaTransformerDecoder": ("_compute_self_attention_mask",
                                "decoder_sequence"),
    "MistralTransformerDecoder": ("_compute_self_attention_mask",
                                  "decoder_sequence"),
    "QwenTransformerDecoder": ("_compute_self_attention_mask",
                               "decoder_sequence"),
    "GemmaDecoderBlock": ("_compute_attention_mask", "x"),
}

# Normalization layers of keras-hub's families: each position normalized
# over its features alone (so they run on sequence slices).
POSITION_WISE_NORMS = ("LlamaLayerNorm", "MistralLayerNormalization",
                       "QwenLayerNorm", "RMSNormalization")


def block_class(layer):
  """The registered keras-hub block class name of `layer` (its class or a
  base class), or None."""
  for cls in type(layer).__mro__:
    if cls.__name__ in BLOCK_MASKS and cls.__module__.startswith(
        "keras_hub."):
      return cls.__name__
  return None


def is_position_wise_norm(layer):
  """Whether `layer` is one of keras-hub's normalization layers."""
  cls = type(layer)
  return cls.__name__ in POSITION_WISE_NORMS and cls.__module__.startswith(
      "keras_hub.")


def wrap_attention_mask(block, replace):
  """Makes `block`'s attention-mask method read its sequence argument
  through `replace(sequence)` (on this instance).

  Args:
    block: a layer `block_class` registers.
    replace: maps the sequence tensor to the one the mask is computed from.
  """
  entry = BLOCK_MASKS[block_class(block)]
  if entry is None or getattr(block, "_tfpar_mask_wrapped", False):
    return
  method_name, argument = entry
  original = require(block, method_name,
                     "the attention mask of a block run on sequence slices")

  def method(*args, **kwargs):
    if argument in kwargs:
      kwargs[argument] = replace(kwargs[argument])
    else:
      args = (replace(args[0]),) + tuple(args[1:])
    return original(*args, **kwargs)
  object.__setattr__(block, method_name, method)
  object.__setattr__(block, "_tfpar_mask_wrapped", True)
