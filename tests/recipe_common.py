"""What the recipe tests share: examples/train_with_recipe.py's model, data
and loss recorder, and a fit that returns the per-step losses."""

import contextlib
import importlib.util
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_with_recipe.py")
ROWS = 48
BATCH = 16  # A multiple of data x num_microbatches of every recipe here.


def _import_example():
  spec = importlib.util.spec_from_file_location("train_with_recipe", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


example = _import_example()


def fit_losses(strategy=None, callbacks=()):
  """Trains the example's model for one epoch of ROWS rows, batch BATCH.

  Args:
    strategy: the strategy to build and compile under; None: one device.
    callbacks: extra Keras callbacks (a recipe's).

  Returns:
    The per-step losses as a NumPy array.
  """
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    model = example.compile_model(example.token_model())
  x, y = example.token_data(ROWS)
  record = example.StepLosses()
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
            callbacks=[*callbacks, record])
  return np.array(record.losses)
