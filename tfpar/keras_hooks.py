"""The two hooks tfpar adds to Keras's TensorFlow trainer.

* Model registration: Keras records the strategy current when a model is
  created (`Model must be created under scope of DistStrat it will be
  trained with`, keras/src/backend/tensorflow/trainer.py) but never tells
  the strategy, and a tensor-parallel strategy cannot otherwise find the
  models it must shard. Models created in scope call
  `strategy.extended.register_model(model)` when it exists.
* `fit` preparation: `fit` builds the optimizer before any callback runs,
  so a callback that must change the optimizer before it is built
  (`tfpar.ZeRO`) cannot do it from the callback API. `fit` calls
  `callback.prepare_fit(model)` on every callback that has it, first.

Both patches are installed once per process and are idempotent.
"""

import functools

from keras.src.backend.tensorflow import trainer as tf_trainer

_installed = set()


def install_model_registration():
  """Patches `TensorFlowTrainer.__init__` to register models."""
  if "registration" in _installed:
    return
  original = tf_trainer.TensorFlowTrainer.__init__

  @functools.wraps(original)
  def __init__(self, *args, **kwargs):
    original(self, *args, **kwargs)
    strategy = getattr(self, "_distribute_strategy", None)
    register = getattr(getattr(strategy, "extended", None), "register_model",
                       None)
    if register is not None:
      register(self)

  tf_trainer.TensorFlowTrainer.__init__ = __init__
  _installed.add("registration")


def install_fit_preparation():
  """Patches `TensorFlowTrainer.fit` to call `prepare_fit` on callbacks."""
  if "fit" in _installed:
    return
  original = tf_trainer.TensorFlowTrainer.fit

  @functools.wraps(original)
  def fit(self, *args, callbacks=None, **kwargs):
    for callback in callbacks or ():
      prepare = getattr(callback, "prepare_fit", None)
      if prepare is not None:
        prepare(self)
    return original(self, *args, callbacks=callbacks, **kwargs)

  tf_trainer.TensorFlowTrainer.fit = fit
  _installed.add("fit")
