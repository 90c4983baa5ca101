"""The one hook tfpar adds to Keras: models created in a tensor-parallel
strategy's scope register with it.

Keras's TensorFlow trainer records the strategy current when a model is
created (`Model must be created under scope of DistStrat it will be trained
with`, keras/src/backend/tensorflow/trainer.py) but never tells the
strategy, and a strategy cannot otherwise find the models it must shard.
"""

import functools

from keras.src.backend.tensorflow import trainer as tf_trainer

_installed = False


def install():
  """Patches `TensorFlowTrainer.__init__` once per process (idempotent)."""
  global _installed
  if _installed:
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
  _installed = True
