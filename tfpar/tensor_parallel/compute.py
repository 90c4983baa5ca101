"""Running one shard's computation on its device, forward and backward.

`tf.GradientTape` places gradient ops on the device active when
`tape.gradient` runs (the replica's head), not next to their forward ops
(../shared/notes/tensor-parallel-probe.md). `on_device` records the shard's
forward on an inner tape and replays its gradient under the same device.
"""

import tensorflow as tf


def on_device(device, fn, *inputs):
  """`fn(*inputs)` with its forward and backward ops on `device`.

  Args:
    device: the device string.
    fn: a function of tensors returning a tensor or a tuple of tensors; it
      may read variables (their gradients are placed on `device` too).
    *inputs: tensors, already on `device`. Non-float inputs get no gradient.

  Returns:
    What `fn` returns.
  """
  differentiable = [x.dtype.is_floating for x in inputs]

  @tf.custom_gradient
  def _block(*xs):
    with tf.device(device):
      with tf.GradientTape() as tape:
        # Fresh identities: one tensor passed as several arguments (query,
        # key and value of self-attention) must get each use's gradient once.
        xs = [tf.identity(x) for x in xs]
        tape.watch([x for x, d in zip(xs, differentiable) if d])
        result = fn(*xs)

    def grad(*upstream, variables=None):
      variables = list(variables or ())
      sources = [x for x, d in zip(xs, differentiable) if d] + variables
      outputs = list(result) if isinstance(result, (tuple, list)) else [result]
      kept = [(o, u) for o, u in zip(outputs, upstream) if u is not None]
      with tf.device(device):
        grads = tape.gradient(
            [o for o, _ in kept], sources,
            output_gradients=[u for _, u in kept],
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      input_grads, position = [], 0
      for d in differentiable:
        input_grads.append(grads[position] if d else None)
        position += d
      return input_grads, grads[position:]

    return result, grad

  return _block(*inputs)
