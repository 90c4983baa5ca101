"""Keras's guide "Distributed tuning with Gemma using Keras", small, on tfpar.

The guide's code, written for JAX, runs on TensorFlow as it is: a
`keras.distribution.DeviceMesh` of (batch 1, model 4), a `LayoutMap` (the
guide's hand-written kind, or keras-hub's `GemmaBackbone.get_layout_map`),
`keras.distribution.set_distribution(ModelParallel(...))`, then plain Keras
with no tfpar scope: `GemmaCausalLM`, `backbone.enable_lora(rank=4)`, AdamW
without weight decay on biases and scales, `fit` on raw strings through the
model's preprocessor, and greedy `generate` on a prompt. Importing tfpar is
what makes `set_distribution` work on TensorFlow: the layout map becomes a
`tfpar.TensorParallelStrategy` (attention split by heads with its LoRA
factors, the MLP column- then row-parallel, the embedding by vocabulary),
and `generate` runs split too, each device caching its heads' keys and
values.

The guide tunes a 7B preset on 8 TPU cores. Here, with nothing downloaded,
the model is a 2-block Gemma from a small config whose SentencePiece
tokenizer is trained on the spot on the text this directory ships
(examples/data/parallel_training_notes.txt). Its random-init weights are
first trained in full for `--base_steps` (standing in for the preset's
pretraining; 0 tunes LoRA on the random base, which lowers the loss but
generates nothing readable), then LoRA-tuned. On 4 virtual CPUs, in under
a minute of CPU time:

  python examples/finetune_gemma_lora.py
  python examples/finetune_gemma_lora.py --mesh=2x2 --layout_map=keras_hub

A Gemma preset you have on disk (a directory from `save_to_preset` or a
Kaggle download) in place of the small model, and the guide's IMDB
reviews (TFDS, needs the network):

  python examples/finetune_gemma_lora.py --preset=/path/to/gemma_2b_en \\
      --dataset=imdb_reviews --sequence_length=128 --learning_rate=5e-5

`--compare_one_device` then tunes the same model on one device and prints
the largest weight difference and whether the generated text is the same.
"""

import io
import os

from absl import app
from absl import flags
import keras
import keras_hub
import numpy as np
import sentencepiece
import tensorflow as tf

import tfpar
from text_data import load_text

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", None, "A GemmaCausalLM preset on disk "
                    "(a directory) instead of the small random-init model.")
flags.DEFINE_string("dataset", None, "Tune on this TFDS text dataset (e.g. "
                    "imdb_reviews, the guide's; needs the network).")
flags.DEFINE_string("text_file", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "data",
    "parallel_training_notes.txt"), "Tune on this text, one example a line.")
flags.DEFINE_integer("base_steps", 200, "Steps of full training of the "
                     "small model before LoRA, standing in for a preset's "
                     "pretraining (0: LoRA on the random-init base).")
flags.DEFINE_integer("steps", 120, "LoRA optimizer steps.")
flags.DEFINE_integer("epochs", 4, "Epochs the steps are divided into (the "
                     "loss is printed per epoch).")
flags.DEFINE_integer("batch_size", 8, "Global batch size (lines of text).")
flags.DEFINE_integer("sequence_length", 32, "Tokens per example.")
flags.DEFINE_integer("lora_rank", 4, "LoRA rank.")
flags.DEFINE_float("learning_rate", 1e-2, "AdamW learning rate.")
flags.DEFINE_string("mesh", "1x4", "Device mesh, batch x model.")
flags.DEFINE_enum("layout_map", "guide", ["guide", "keras_hub"],
                  "The guide's hand-written LayoutMap, or keras-hub's "
                  "GemmaBackbone.get_layout_map.")
flags.DEFINE_string("prompt", "The river", "Prompt for generate.")
flags.DEFINE_integer("max_length", 24, "Tokens generate returns, prompt "
                     "included.")
flags.DEFINE_integer("seed", 0, "Seed of the weights, LoRA and data order.")
flags.DEFINE_bool("compare_one_device", False, "Tune again on one device "
                  "and compare weights and generated text.")

# The small model: Gemma's shapes (one key/value head, as Gemma 2B) scaled
# down; 4 query heads split over a model axis of up to 4 devices.
SMALL_GEMMA = dict(num_layers=2, num_query_heads=4, num_key_value_heads=1,
                   hidden_dim=64, intermediate_dim=256, head_dim=16)
VOCABULARY = 256  # A multiple of the model axis: the embedding is split.
BASE_LEARNING_RATE = 3e-3


def guide_layout_map(device_mesh, model_dim="model"):
  """The LayoutMap the guide writes by hand (keras-hub's weight paths)."""
  layout_map = keras.distribution.LayoutMap(device_mesh)
  layout_map["token_embedding/embeddings"] = (model_dim, None)
  layout_map["decoder_block.*attention.*(query|key|value).kernel"] = (
      model_dim, None, None)
  layout_map["decoder_block.*attention_output.kernel"] = (
      model_dim, None, None)
  layout_map["decoder_block.*ffw_gating.kernel"] = (None, model_dim)
  layout_map["decoder_block.*ffw_gating_2.kernel"] = (None, model_dim)
  layout_map["decoder_block.*ffw_linear.kernel"] = (model_dim, None)
  return layout_map


def sentence_piece_proto(lines):
  """A SentencePiece model with Gemma's special tokens, trained on `lines`."""
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model,
      vocab_size=VOCABULARY, model_type="unigram", pad_id=0, bos_id=1,
      eos_id=2, unk_id=3, pad_piece="<pad>", bos_piece="<bos>",
      eos_piece="<eos>", unk_piece="<unk>", input_sentence_size=20000,
      minloglevel=2)
  return model.getvalue()


def gemma_causal_lm(proto):
  """The guide's model: a preset, or the small config with `proto`'s
  tokenizer. Seeded first: `keras.utils.set_random_seed` clears
  TensorFlow's kernel caches, which frees the SentencePiece resource of a
  tokenizer made before it (tf-text; fails on one device too)."""
  keras.utils.set_random_seed(FLAGS.seed)
  if FLAGS.preset:
    causal_lm = keras_hub.models.GemmaCausalLM.from_preset(FLAGS.preset)
  else:
    tokenizer = keras_hub.models.GemmaTokenizer(proto=proto)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), **SMALL_GEMMA)
    causal_lm = keras_hub.models.GemmaCausalLM(
        backbone, keras_hub.models.GemmaCausalLMPreprocessor(tokenizer))
  causal_lm.preprocessor.sequence_length = FLAGS.sequence_length
  return causal_lm


def compile_for_tuning(causal_lm, learning_rate):
  """The guide's compile: AdamW, no weight decay on biases and scales."""
  optimizer = keras.optimizers.AdamW(learning_rate=learning_rate,
                                     weight_decay=0.01)
  optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
  causal_lm.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=optimizer,
      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
      sampler="greedy")


def shuffled(lines, steps):
  """`lines` in as many seeded random orders as `steps` batches read, one
  after the other. Shuffled here rather than by `Dataset.shuffle`, which
  reshuffles for every iterator: under any `tf.distribute` strategy (stock
  `MirroredStrategy` too) Keras opens one more iterator than on one device
  to build the model, so the order would differ from one device's."""
  rng = np.random.default_rng(FLAGS.seed)
  passes = -(-steps * FLAGS.batch_size // len(lines))
  return [lines[i] for _ in range(passes) for i in rng.permutation(len(lines))]


def tune_and_generate(proto, lines):
  """The guide's steps: the model, LoRA, compile, fit on strings, generate.

  Returns the model, the loss of each epoch, whether LoRA tuning left every
  weight of the base as it was, and the generated text."""
  causal_lm = gemma_causal_lm(proto)
  base_steps = 0 if FLAGS.preset else FLAGS.base_steps
  data = tf.data.Dataset.from_tensor_slices(
      shuffled(lines, base_steps + FLAGS.steps)).batch(
          FLAGS.batch_size, drop_remainder=True)
  if base_steps:  # Stands in for a preset's pretraining: every weight.
    compile_for_tuning(causal_lm, BASE_LEARNING_RATE)
    causal_lm.fit(data.take(base_steps), verbose=0)
  base = tfpar.logical_weights(causal_lm)

  causal_lm.backbone.enable_lora(rank=FLAGS.lora_rank)
  compile_for_tuning(causal_lm, FLAGS.learning_rate)
  history = causal_lm.fit(data.skip(base_steps).repeat(),
                          epochs=FLAGS.epochs,
                          steps_per_epoch=FLAGS.steps // FLAGS.epochs,
                          verbose=2)
  tuned = tfpar.logical_weights(causal_lm)
  base_kept = all(np.array_equal(base[path], tuned[path]) for path in base)
  text = causal_lm.generate(FLAGS.prompt, max_length=FLAGS.max_length)
  return causal_lm, history.history["loss"], base_kept, text


def fullest_bytes(causal_lm):
  """Bytes of parameters and optimizer state on the fullest device, and of
  the whole model's parameters."""
  report = tfpar.memory_report(causal_lm)
  device = max(report.devices, key=report.total)
  whole = sum(int(np.prod(w.shape)) * tf.as_dtype(w.dtype).size
              for w in causal_lm.weights)
  return (f"parameters {report.parameters.get(device, 0):,} of the "
          f"model's {whole:,} bytes, optimizer "
          f"{report.optimizer.get(device, 0):,} bytes")


def main(argv):
  del argv
  if not tf.config.list_physical_devices("GPU") and not os.environ.get(
      "TF_CONFIG"):
    tfpar.configure_virtual_cpus(4)
  batch, model = (int(n) for n in FLAGS.mesh.split("x"))
  text = load_text(None if FLAGS.dataset else FLAGS.text_file, FLAGS.dataset)
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  proto = None if FLAGS.preset else sentence_piece_proto(lines)
  print(f"text: {len(lines):,} lines; SentencePiece vocabulary "
        f"{'of the preset' if FLAGS.preset else VOCABULARY}")

  # The guide: a mesh, a layout map, ModelParallel, set_distribution.
  device_mesh = keras.distribution.DeviceMesh(
      (batch, model), ["batch", "model"],
      devices=keras.distribution.list_devices()[:batch * model])
  layout_map = (guide_layout_map(device_mesh) if FLAGS.layout_map == "guide"
                else keras_hub.models.GemmaBackbone.get_layout_map(
                    device_mesh))
  model_parallel = keras.distribution.ModelParallel(
      layout_map=layout_map, batch_dim_name="batch")
  keras.distribution.set_distribution(model_parallel)
  strategy = tf.distribute.get_strategy()
  print(f"set_distribution: {type(strategy).__name__} on {strategy.mesh}")

  causal_lm, losses, base_kept, generated = tune_and_generate(proto, lines)
  trainable = [w for w in causal_lm.weights if w.trainable]  # Whole.
  print(f"trainable weights ({sum(int(np.prod(w.shape)) for w in trainable):,}"
        f" of {causal_lm.count_params():,} parameters): "
        + ", ".join(w.path for w in trainable))
  print(f"base weights unchanged by LoRA tuning: {base_kept}")
  print(f"fullest device: {fullest_bytes(causal_lm)}")
  print("loss per epoch: " + " ".join(f"{loss:.4f}" for loss in losses))
  print(f"Gemma LoRA (batch {batch} x model {model}): loss {losses[0]:.4f} "
        f"-> {losses[-1]:.4f}")
  print(f"generated: {generated!r}")

  if FLAGS.compare_one_device:
    tuned = tfpar.logical_weights(causal_lm)
    keras.distribution.set_distribution(None)
    one_lm, _, _, one_generated = tune_and_generate(proto, lines)
    expected = tfpar.logical_weights(one_lm)
    worst = max(float(np.abs(tuned[p] - expected[p]).max()) for p in expected)
    print(f"one device: {fullest_bytes(one_lm)}")
    print(f"one device: largest weight difference {worst:.1e}; generated "
          f"text the same: {one_generated == generated}")


if __name__ == "__main__":
  app.run(main)
