"""keras-hub backbones from small configs, data and per-device accounting
shared by the keras-hub tests (random init, nothing downloaded)."""

import collections
import functools

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import one_device_optimizer
import tfpar
from tfpar.common import whole_weights

VOCAB = 64
SEQUENCE = 8
BATCH = 8
STEPS = 10

_DECODER = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=32,
                intermediate_dim=128)
FAMILIES = {
    "gpt2": lambda: keras_hub.models.GPT2Backbone(
        num_heads=4, max_sequence_length=16, dropout=0.0, **_DECODER),
    "bert": lambda: keras_hub.models.BertBackbone(
        num_heads=4, max_sequence_length=16, dropout=0.0, **_DECODER),
    "llama": lambda: keras_hub.models.LlamaBackbone(
        num_query_heads=4, num_key_value_heads=2, **_DECODER),
    "mistral": lambda: keras_hub.models.MistralBackbone(
        num_query_heads=4, num_key_value_heads=2, **_DECODER),
    "qwen2": lambda: keras_hub.models.QwenBackbone(
        num_query_heads=4, num_key_value_heads=2, **_DECODER),
    # One key/value head: multi-query attention.
    "gemma": lambda: keras_hub.models.GemmaBackbone(
        num_query_heads=4, num_key_value_heads=1, head_dim=8, **_DECODER),
}


def language_model(family, seed=1):
  """The backbone with a next-token head: its own token embedding reversed
  (as keras-hub's CausalLM does) or, for BERT, a Dense."""
  keras.utils.set_random_seed(seed)
  backbone = FAMILIES[family]()
  hidden = backbone.output
  if isinstance(hidden, dict):
    hidden = hidden["sequence_output"]
  if family == "bert":
    logits = keras.layers.Dense(VOCAB, name="head")(hidden)
  else:
    logits = backbone.token_embedding(hidden, reverse=True)
  return keras.Model(backbone.input, logits, name=f"{family}_lm")


def data(family, count=BATCH * STEPS, seed=0):
  """(inputs dict, next-token targets), with some padding at the end."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, VOCAB, size=(count, SEQUENCE + 1)).astype("int32")
  mask = np.ones((count, SEQUENCE), "int32")
  mask[:, -2:] = rng.integers(0, 2, size=(count, 2))
  inputs = {"token_ids": ids[:, :-1], "padding_mask": mask}
  if family == "bert":
    inputs["segment_ids"] = np.zeros_like(mask)
  return inputs, ids[:, 1:]


def optimizer(name):
  if name == "adam":
    return keras.optimizers.Adam(0.01)
  return keras.optimizers.SGD(0.1, momentum=0.9)


def train(family, optimizer_name, strategy=None):
  """(model, per-step losses) after STEPS steps of `model.fit`."""
  scope = strategy.scope() if strategy else tf.distribute.get_strategy(
      ).scope()
  with scope:
    model = language_model(family)
    model.compile(
        optimizer=optimizer(optimizer_name),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = data(family)
  losses = []
  one_device_optimizer.build(model)
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, logs: losses.append(
                    logs["loss"]))])
  return model, np.array(losses)


@functools.lru_cache(maxsize=None)
def reference(family, optimizer_name):
  """`train(family, optimizer_name)` on one device, computed once."""
  return train(family, optimizer_name)


def bytes_by_device(model, prefix=""):
  """{device: bytes} of the model's variables (every shard, replica and
  ZeRO slice) whose path starts with `prefix`, counted from the per-device
  tf.Variables that hold them."""
  found = collections.Counter()
  for variable in whole_weights.held(model):  # Shards, not whole weights.
    if not variable.path.startswith(prefix):
      continue
    value = variable._value  # pylint: disable=protected-access
    for component in getattr(value, "values", (value,)):
      size = int(np.prod(component.shape)) * component.dtype.size
      found[tf.DeviceSpec.from_string(component.device).to_string()] += size
  return found


def block_prefixes(model):
  """The path prefixes of the transformer blocks of a language model."""
  return sorted({v.path.split("/")[0] + "/" for v in model.weights
                 if v.path.split("/")[0].startswith(
                     ("transformer_layer_", "decoder_block_"))})
