"""keras-hub's private attribute names tfpar reads.

keras-hub keeps the head counts of some attention layers and the expert
weights and router of its mixture-of-experts blocks in private attributes.
tfpar's family tables (tensor_parallel/families.py,
expert_parallel/families.py) name them through these constants and check
each one on the layer before splitting it, so a keras-hub upgrade that
renamed one stops with an error naming it instead of replicating the
layer.
"""

from tfpar._compat.checks import require

# CachedMistralAttention (Mistral, Mixtral) keeps its head counts private.
MISTRAL_HEADS = dict(query_heads="_num_query_heads",
                     key_value_heads="_num_key_value_heads",
                     groups="_num_key_value_groups")

# The attention Dropout of keras-hub's attention layers, by class name
# (Gemma's is public); tensor_parallel/spmd/dropout.py draws it.
ATTENTION_DROPOUT = {
    "LlamaAttention": "_dropout_layer",
    "QwenAttention": "_dropout_layer",
    "CachedMistralAttention": "_dropout_layer",
    "CachedGemmaAttention": "dropout_layer",
    "CachedGemma3Attention": "dropout_layer",
}

# The expert weights ([num_experts, ...]) of an MoE block's expert bank.
MIXTRAL_EXPERT_WEIGHTS = ("_expert_feedforward_gate_dense",
                          "_expert_feedforward_intermediate_dense",
                          "_expert_feedforward_output_dense")
QWEN_MOE_EXPERT_WEIGHTS = ("_expert_feedforward_gate_dense",
                           "_expert_feedforward_output_dense")

# An MoE block's router (a Dense from hidden size to num_experts).
MOE_ROUTER = "_sparse_feedforward_gate_dense"


def router(block):
  """An MoE block's router layer."""
  return require(block, MOE_ROUTER, "mixture-of-experts routing")
