"""keras-hub task models trained on raw strings through their
preprocessors under tfpar's strategies give one device's weights.

Keras's symbolic build reduces the first preprocessed batch across
replicas (`strategy.reduce("MEAN", batch)`), which fails on the boolean
`padding_mask` under every `tf.distribute` strategy; tfpar's strategies
hand Keras one replica's batch instead (`keras_hooks`,
`MeshExtended.symbolic_build_batch`). Stock `MirroredStrategy` still
fails, as docs/keras_hub.md says.

The models: `GPT2CausalLM` with `GPT2CausalLMPreprocessor` (a byte-level
BPE vocabulary of single letters and two merges, made here) and
`BertTextClassifier` with `BertTextClassifierPreprocessor` (a WordPiece
vocabulary trained here on the texts), small configs, dropout 0, the same
initial weights as the one-device model, 3 steps of `fit`.
"""

import functools

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import stock_strategies
import tfpar

WORDS = ("the cat sat on a mat while birds fly over green trees and "
         "fish swim in deep blue sea near old red boats").split()
BATCH = 8
TEXTS = [" ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(2 + i % 3))
         for i in range(3 * BATCH)]
LABELS = np.array([i % 2 for i in range(len(TEXTS))], "int32")
SEQUENCE = 8


def _gpt2_preprocessor():
  # GPT-2's byte-level alphabet writes a space as "\u0120".
  letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
  tokens = ["<|endoftext|>", "\u0120"] + letters + ["th", "\u0120t"]
  tokenizer = keras_hub.models.GPT2Tokenizer(
      vocabulary={t: i for i, t in enumerate(tokens)},
      merges=["t h", "\u0120 t"])
  return keras_hub.models.GPT2CausalLMPreprocessor(
      tokenizer, sequence_length=SEQUENCE)


@functools.lru_cache(maxsize=None)
def _word_pieces():
  return tuple(keras_hub.tokenizers.compute_word_piece_vocabulary(
      tf.data.Dataset.from_tensor_slices(TEXTS), vocabulary_size=64,
      reserved_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))


def _bert_preprocessor():
  tokenizer = keras_hub.models.BertTokenizer(vocabulary=list(_word_pieces()))
  return keras_hub.models.BertTextClassifierPreprocessor(
      tokenizer, sequence_length=SEQUENCE)


def _causal_lm(preprocessor):
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
      num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
      max_sequence_length=16, dropout=0.0)
  return keras_hub.models.GPT2CausalLM(backbone, preprocessor)


def _classifier(preprocessor):
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
      num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
      max_sequence_length=16, dropout=0.0)
  return keras_hub.models.BertTextClassifier(
      backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0)


TASKS = {"causal_lm": (_causal_lm, _gpt2_preprocessor),
         "classifier": (_classifier, _bert_preprocessor)}


def _optimizer(name):
  if name == "adam":
    return keras.optimizers.Adam(0.01)
  return keras.optimizers.SGD(0.1, momentum=0.9)


def _data(task, form):
  """(fit's x, y): a list of strings or a batched tf.data of strings."""
  labels = LABELS if task == "classifier" else None
  if form == "list":
    return TEXTS, labels
  parts = TEXTS if labels is None else (TEXTS, labels)
  return tf.data.Dataset.from_tensor_slices(parts).batch(BATCH), None


@functools.lru_cache(maxsize=None)
def _one_device_model(task):
  """(one device's model, its initial weights), built once per task: the
  reference trains this model, every other model starts from its weights."""
  keras.utils.set_random_seed(1)
  make_model, make_preprocessor = TASKS[task]
  model = make_model(make_preprocessor())
  return model, tuple(model.get_weights())


def _initial_weights(task):
  return _one_device_model(task)[1]


def _fit(model, task, optimizer, form, strategy):
  with strategy.scope():
    model.compile(optimizer=_optimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  x, y = _data(task, form)
  model.fit(x, y, batch_size=BATCH if form == "list" else None, epochs=1,
            shuffle=False, verbose=0)
  return model


def _train(task, optimizer, form, strategy=None, preprocessor_in_scope=True):
  make_model, make_preprocessor = TASKS[task]
  preprocessor = None if preprocessor_in_scope else make_preprocessor()
  strategy = strategy or tf.distribute.get_strategy()
  with strategy.scope():
    model = make_model(preprocessor or make_preprocessor())
  model.set_weights(list(_initial_weights(task)))
  return _fit(model, task, optimizer, form, strategy)


_TRAINED = set()


@functools.lru_cache(maxsize=None)
def _reference(task, optimizer):
  """One device's weights after training from a list of strings (its
  preprocessor made in the default scope), computed once."""
  model = _one_device_model(task)[0]
  # The model trains once: one reference optimizer per task.
  assert task not in _TRAINED, (task, optimizer)
  _TRAINED.add(task)
  return tfpar.logical_weights(
      _fit(model, task, optimizer, "list", tf.distribute.get_strategy()))


def _largest_difference(model, task, optimizer):
  expected = _reference(task, optimizer)
  got = tfpar.logical_weights(model)
  assert sorted(got) == sorted(expected)
  return max(float(np.abs(got[p] - expected[p]).max()) for p in expected)


STRATEGIES = {
    "data2": lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 2}, devices=tfpar.Mesh().devices[:2])),
    "data2_tensor2": lambda: tfpar.TensorParallelStrategy(
        tfpar.Mesh({"data": 2, "tensor": 2})),
    "data2_pipeline2": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2),
}

# (strategy, task, optimizer, fit's input, preprocessor created in scope):
# each strategy trains both tasks (the causal LM with SGD-momentum, the
# classifier with Adam), from a list and from a tf.data of strings, with
# the preprocessor created in and out of its scope.
CASES = [
    ("data2", "causal_lm", "sgd", "list", True),
    ("data2", "classifier", "adam", "dataset", False),
    ("data2_tensor2", "causal_lm", "sgd", "dataset", False),
    ("data2_tensor2", "classifier", "adam", "list", True),
    ("data2_pipeline2", "causal_lm", "sgd", "list", False),
    ("data2_pipeline2", "classifier", "adam", "dataset", True),
]


@pytest.mark.parametrize("layout,task,optimizer,form,in_scope", CASES)
def test_task_model_with_preprocessor_trains_like_one_device(
    layout, task, optimizer, form, in_scope):
  model = _train(task, optimizer, form, STRATEGIES[layout](),
                 preprocessor_in_scope=in_scope)
  difference = _largest_difference(model, task, optimizer)
  assert difference < 1e-5, difference


def test_stock_mirrored_strategy_fails_on_the_boolean_mask():
  """What docs/keras_hub.md says of stock strategies: Keras's own
  symbolic build reduces the preprocessed batch, boolean mask included."""
  strategy = stock_strategies.mirrored(["/cpu:0", "/cpu:1"])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="attr 'T' of bool"):
    _train("causal_lm", "sgd", "list", strategy)
