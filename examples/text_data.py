"""Text shipped with Python, as next-character training data for the
examples (nothing downloaded), or a TFDS text dataset by name."""

import importlib
import inspect

import numpy as np
import tensorflow as tf


# Pure-Python standard-library modules whose docstrings make the default
# corpus: about 70 KB of English, the same on every machine with the same
# Python version, and no download.
STDLIB_MODULES = ("textwrap", "json", "collections", "functools", "argparse",
                  "random", "statistics", "heapq", "shutil", "subprocess")


def stdlib_docstrings(modules=STDLIB_MODULES):
  """The docstrings of `modules` and of their public functions and classes."""
  docs = []
  for name in modules:
    module = importlib.import_module(name)
    docs.append(inspect.getdoc(module) or "")
    for attribute, value in sorted(vars(module).items()):
      if attribute.startswith("_") or getattr(
          value, "__module__", None) != module.__name__:
        continue
      doc = inspect.getdoc(value)
      if doc:
        docs.append(doc)
  return "\n\n".join(docs)


def tfds_text(name):
  """The train split of a TFDS text dataset (one `text` feature) as one
  string."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  pieces = tfds.as_numpy(tfds.load(name, split="train"))
  return "\n".join(example["text"].decode("utf-8") for example in pieces)


class CharVocabulary:
  """Characters <-> ids; the size is padded to a multiple of `multiple` so
  the embedding and the head split evenly over the tensor axis."""

  def __init__(self, text, multiple):
    self.chars = sorted(set(text))
    self.size = -(-len(self.chars) // multiple) * multiple
    self._ids = {c: i for i, c in enumerate(self.chars)}

  def encode(self, text):
    return np.array([self._ids[c] for c in text], dtype="int32")

  def decode(self, ids):
    return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids)


def next_char_dataset(ids, sequence, batch_size, seed=0):
  """Endless shuffled batches of (chars, the chars one position later),
  from windows starting every `sequence // 2` characters."""
  starts = np.arange(0, len(ids) - sequence - 1, max(1, sequence // 2))
  windows = ids[starts[:, None] + np.arange(sequence + 1)]
  dataset = tf.data.Dataset.from_tensor_slices(
      (windows[:, :-1], windows[:, 1:]))
  return dataset.shuffle(len(windows), seed=seed).repeat().batch(
      batch_size, drop_remainder=True).prefetch(2)


def load_text(text_file=None, dataset=None):
  """The examples' corpus: `text_file`, the TFDS text `dataset`, or (the
  default) the standard-library docstrings."""
  if text_file and dataset:
    raise ValueError(f"Pass at most one of --text_file and --dataset. "
                     f"Received: text_file={text_file!r}, dataset={dataset!r}")
  if text_file:
    with open(text_file, encoding="utf-8") as f:
      return f.read()
  if dataset:
    return tfds_text(dataset)
  return stdlib_docstrings()
