"""Builds a one-device reference model's optimizer before its first `fit`."""

import tensorflow as tf


def build(model):
  """Creates the optimizer's variables of a compiled model that runs on one
  device (no strategy), as Keras itself does before a first `fit` under a
  strategy. Without it Keras creates them inside the first traced step, and
  `tf.function` then traces the step twice: `tp_common`'s GPT took 2.84 CPU
  s to fit on one device, 1.31 s with this (median of 5 alternating pairs,
  same losses). The variables start as Keras makes them either way, so the
  reference trains the same. Models under a strategy, unbuilt models and
  built optimizers are left alone.

  Args:
    model: a compiled `keras.Model`.

  """
  on_one_device = (not tf.distribute.has_strategy() and
                   model.distribute_strategy is tf.distribute.get_strategy())
  optimizer = getattr(model, "optimizer", None)
  if (on_one_device and model.built and optimizer is not None and
      not optimizer.built):
    optimizer.build(model.trainable_variables)
