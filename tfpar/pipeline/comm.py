"""Moving activations and their gradients between pipeline stages.

A stage's input is copied onto the stage's device before the stage reads
it; TF turns the copy into a send/receive pair between devices (or between
workers over gRPC). The copy is part of the receiving stage's scheduled
work, so it waits for that stage's previous work like the rest of it.
"""

import tensorflow as tf


def send(structure, device):
  """Copies every tensor of `structure` onto `device`.

  Args:
    structure: a nest of tensors (or None).
    device: the receiving stage's device name.

  Returns:
    The same nest, with tensors on `device`.

  Example:

  >>> import tensorflow as tf
  >>> from tfpar.pipeline.comm import send
  >>> send({"x": tf.ones(2)}, "/CPU:0")["x"].device.endswith("CPU:0")
  True
  """
  with tf.device(device):
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.identity(t), structure)
