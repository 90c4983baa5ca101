"""Trains a GPT-style character language model tensor-parallel with tfpar.

The model is stock Keras (token and position `Embedding`s, pre-LayerNorm
blocks of causal `MultiHeadAttention` and a GELU MLP, a vocabulary head);
`tfpar.TensorParallelStrategy` splits it Megatron-style over the mesh's
`tensor` axis: attention by heads, the MLP column- then row-parallel, the
embeddings on the vocabulary, and here, through a `tfpar.ShardingPlan`
rule, the vocabulary head column-parallel. The `data` axis takes the
remaining devices.

One host, 4 virtual CPUs (no GPU needed) as data 2 x tensor 2, trained on
the docstrings of a few Python standard-library modules (nothing
downloaded):

  python examples/train_char_lm_tensor_parallel.py

The same script across 2 local TF_CONFIG workers with 2 virtual CPUs each
(tensor 2 inside each worker, data 2 across them):

  tfpar launch --workers 2 --devices-per-worker 2 examples/train_char_lm_tensor_parallel.py

Your own text, or with the network a TFDS text dataset:

  python examples/train_char_lm_tensor_parallel.py --text_file=my.txt
  python examples/train_char_lm_tensor_parallel.py --dataset=tiny_shakespeare
"""

import os

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfpar
from text_data import CharVocabulary
from text_data import load_text
from text_data import next_char_dataset

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 4, "Virtual CPUs on a CPU-only host when not "
                     "run by `tfpar launch`.")
flags.DEFINE_integer("tensor", 2, "Size of the mesh's tensor axis; data "
                     "takes the remaining devices.")
flags.DEFINE_integer("epochs", 10, "Training epochs.")
flags.DEFINE_integer("steps_per_epoch", 50, "Optimizer steps per epoch.")
flags.DEFINE_integer("batch_size", 32, "Global batch size (sequences).")
flags.DEFINE_integer("sequence", 64, "Characters per training sequence.")
flags.DEFINE_integer("width", 64, "Model width.")
flags.DEFINE_integer("heads", 4, "Attention heads (a multiple of --tensor).")
flags.DEFINE_integer("blocks", 2, "Transformer blocks.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("sample_length", 40, "Characters to generate at the end.")
flags.DEFINE_string("text_file", None, "Train on this text file instead of "
                    "the built-in standard-library docstrings.")
flags.DEFINE_string("dataset", None, "Train on this TFDS text dataset "
                    "(e.g. tiny_shakespeare; needs the network) instead.")

def gpt(vocab, sequence, width, heads, blocks):
  """A small GPT from stock Keras layers."""
  tokens = keras.Input((sequence,), dtype="int32")
  x = keras.layers.Embedding(vocab, width, name="tokens")(tokens)
  positions = keras.ops.zeros_like(tokens) + keras.ops.arange(sequence)
  x = x + keras.layers.Embedding(sequence, width, name="positions")(positions)
  for b in range(blocks):
    h = keras.layers.LayerNormalization(name=f"block{b}_ln1")(x)
    h = keras.layers.MultiHeadAttention(heads, width // heads,
                                        name=f"block{b}_attention")(
                                            h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(name=f"block{b}_ln2")(x)
    h = keras.layers.Dense(4 * width, activation="gelu",
                           name=f"block{b}_mlp_in")(h)
    x = x + keras.layers.Dense(width, name=f"block{b}_mlp_out")(h)
  x = keras.layers.LayerNormalization(name="final_ln")(x)
  logits = keras.layers.Dense(vocab, name="lm_head")(x)
  return keras.Model(tokens, logits, name="char_gpt")


def generate(model, vocabulary, prompt_ids, length, replicas):
  """Greedy continuation of `prompt_ids` (one sequence) by `length` chars.

  `model.predict` sees the window repeated once per replica, so every
  replica (and every worker) gets a row; row 0 is the answer.
  """
  window = list(prompt_ids)
  produced = []
  for _ in range(length):
    batch = np.repeat(np.array([window], dtype="int32"), replicas, axis=0)
    logits = model.predict(batch, batch_size=replicas, verbose=0)
    next_id = int(np.argmax(logits[0, -1]))
    produced.append(next_id)
    window = window[1:] + [next_id]
  return vocabulary.decode(produced)


def main(argv):
  del argv
  if not os.environ.get("TF_CONFIG") and not tf.config.list_physical_devices(
      "GPU"):
    tfpar.configure_virtual_cpus(FLAGS.devices)
  mesh = tfpar.Mesh.from_cluster_resolver(data=-1, tensor=FLAGS.tensor)
  # Every rule is a regular expression on Keras variable paths; the built-in
  # plan would replicate this lone Dense, the rule splits its vocabulary
  # outputs (kernel and bias) over the tensor axis instead.
  plan = tfpar.ShardingPlan([(r"^lm_head/", tfpar.ColumnParallel())])
  strategy = tfpar.TensorParallelStrategy(mesh, plan=plan)
  chief = mesh.cluster is None or mesh.cluster.task_index == 0
  if chief:
    print(mesh)

  text = load_text(FLAGS.text_file, FLAGS.dataset)
  vocabulary = CharVocabulary(text, FLAGS.tensor)
  ids = vocabulary.encode(text)
  dataset = next_char_dataset(ids, FLAGS.sequence, FLAGS.batch_size)
  if chief:
    print(f"text: {len(text):,} characters, {len(vocabulary.chars)} distinct "
          f"(vocabulary padded to {vocabulary.size})")

  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = gpt(vocabulary.size, FLAGS.sequence, FLAGS.width, FLAGS.heads,
                FLAGS.blocks)
    model.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  if chief:
    strategy.describe(model)
  history = model.fit(dataset, epochs=FLAGS.epochs,
                      steps_per_epoch=FLAGS.steps_per_epoch,
                      verbose=2 if chief else 0)
  losses = history.history["loss"]

  prompt = ids[:FLAGS.sequence]
  sample = generate(model, vocabulary, prompt, FLAGS.sample_length,
                    strategy.num_replicas_in_sync)
  if chief:
    print(f"tensor-parallel char LM: loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}; sample: {sample!r}")


if __name__ == "__main__":
  app.run(main)
