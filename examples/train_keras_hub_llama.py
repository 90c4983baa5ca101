"""Trains a keras-hub Llama (small config, random init) tensor-parallel.

The model is keras-hub's own `LlamaBackbone` (its subclassed attention with
rotary embeddings and grouped key/value heads, its gated MLP) with its token
embedding reversed as the language-model head, as `LlamaCausalLM` does.
Nothing in it is written for tfpar:

`tfpar.TensorParallelStrategy` on data 2 x tensor 2 splits every block
Megatron-style (attention by heads, gate and up projections column-, the
down projection row-parallel, the embedding on the vocabulary) and prints
its coverage table. With `--layout=pipeline`,
`tfpar.PipelineParallelStrategy` on data 2 x pipeline 2 (1F1B, 4
micro-batches) cuts it into two stages instead: the padding mask crosses
the cut with the hidden states, and the token embedding layer, called by
stage 0 for the inputs and by stage 1 for the logits, lives on stage 0.

One host, 4 virtual CPUs, trained byte by byte on the docstrings of a few
Python standard-library modules (nothing downloaded):

  python examples/train_keras_hub_llama.py
  python examples/train_keras_hub_llama.py --layout=pipeline

Your own text, or with the network a TFDS text dataset:

  python examples/train_keras_hub_llama.py --dataset=tiny_shakespeare
"""

import os

from absl import app
from absl import flags
import keras
import keras_hub
import numpy as np
import tensorflow as tf

import tfpar
from text_data import CharVocabulary
from text_data import load_text
from text_data import next_char_dataset

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 4, "Training epochs.")
flags.DEFINE_integer("steps_per_epoch", 25, "Optimizer steps per epoch.")
flags.DEFINE_integer("batch_size", 16, "Global batch size (sequences).")
flags.DEFINE_integer("sequence", 32, "Characters per training sequence.")
flags.DEFINE_integer("layers", 2, "Llama decoder blocks.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_enum("layout", "tensor", ["tensor", "pipeline"],
                  "data 2 x tensor 2, or data 2 x pipeline 2.")
flags.DEFINE_string("text_file", None, "Train on this text file instead of "
                    "the built-in standard-library docstrings.")
flags.DEFINE_string("dataset", None, "Train on this TFDS text dataset "
                    "(e.g. tiny_shakespeare; needs the network) instead.")


def llama_language_model(vocabulary_size, layers):
  """keras-hub's LlamaBackbone with its token embedding as the head."""
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=vocabulary_size, num_layers=layers, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=64, intermediate_dim=256)
  logits = backbone.token_embedding(backbone.output, reverse=True)
  return keras.Model(backbone.input, logits, name="llama_lm")


def with_padding_mask(dataset):
  """(token_ids, targets) batches as the backbone's dict inputs."""
  return dataset.map(lambda ids, targets: (
      {"token_ids": ids, "padding_mask": tf.ones_like(ids)}, targets))


def main(argv):
  del argv
  if not tf.config.list_physical_devices("GPU") and not os.environ.get(
      "TF_CONFIG"):
    tfpar.configure_virtual_cpus(4)
  if FLAGS.layout == "pipeline":
    strategy = tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=4)
  else:
    strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                        "tensor": 2}))
  print(strategy.mesh)

  text = load_text(FLAGS.text_file, FLAGS.dataset)
  vocabulary = CharVocabulary(text, 2)
  dataset = with_padding_mask(next_char_dataset(
      vocabulary.encode(text), FLAGS.sequence, FLAGS.batch_size))
  print(f"text: {len(text):,} characters, vocabulary {vocabulary.size}")

  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = llama_language_model(vocabulary.size, FLAGS.layers)
    model.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  if FLAGS.layout == "pipeline":
    strategy.describe_stages(model)
  else:
    strategy.describe(model)
  history = model.fit(dataset, epochs=FLAGS.epochs,
                      steps_per_epoch=FLAGS.steps_per_epoch, verbose=2)
  losses = history.history["loss"]
  print(f"keras-hub Llama (data 2 x {FLAGS.layout} 2): loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f} ({np.log(vocabulary.size):.4f} is a uniform "
        f"guess)")


if __name__ == "__main__":
  app.run(main)
