"""keras-hub's private attribute names tfpar reads.

keras-hub keeps the head counts of some attention layers in private
attributes. tensor_parallel/families.py names them through these
constants and checks each one on the layer before splitting it, so a
keras-hub upgrade that renamed one stops with an error naming it instead
of replicating the layer. (Mixture-of-experts blocks need no names here:
expert_parallel/structure.py finds their router and experts from their
layers and weights.)
"""

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
