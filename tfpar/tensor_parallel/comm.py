"""Communication inside one replica's tensor group.

A replica runs on the devices of its `tensor` group; its first device (the
head) holds the replicated activations and runs the unsharded layers
(LayerNorm, residual adds), once. Megatron's all-reduce of partial results
therefore takes two halves here: `reduce` sums the shards' partial results
onto the head and `broadcast` hands the head's activation to every shard.
Together they move the same `2 (t - 1) N` bytes per tensor of `N` bytes as
a ring all-reduce over `t` devices. Every op has a custom gradient that
places its backward half on the right devices: the gradient of a broadcast
is a reduce and that of a reduce a broadcast.
"""

import tensorflow as tf

from tfpar.common import instrument


def _copies(values, devices):
  outs = []
  for value, device in zip(values, devices):
    with tf.device(device):
      outs.append(tf.identity(value))
  return outs


def broadcast(x, devices, layer):
  """`x` (on the head) copied to every device of the group.

  Args:
    x: a tensor on `devices[0]`.
    devices: the group's devices, head first.
    layer: name for the `CommunicationLog`.

  Returns:
    A list with one copy of `x` per device.
  """
  copies = len(devices) - 1
  if not x.dtype.is_floating:
    outs = _copies([x] * len(devices), devices)
    instrument.record("broadcast", instrument.FORWARD,
                      instrument.moved_bytes(x, copies), layer, outs[-1])
    return outs

  @tf.custom_gradient
  def _broadcast(value):
    def grad(*upstream):
      instrument.record("reduce", instrument.BACKWARD,
                        instrument.moved_bytes(upstream[0], copies), layer)
      with tf.device(devices[0]):
        return tf.add_n([u for u in upstream if u is not None])
    return _copies([value] * len(devices), devices), grad

  outs = _broadcast(x)
  instrument.record("broadcast", instrument.FORWARD,
                    instrument.moved_bytes(x, copies), layer, outs[-1])
  return list(outs)


def broadcast_uses(x, uses, devices, layer, round_to):
  """`x` (float32, on the head) copied to every device once, and handed
  out there as `uses` separate tensors: one per projection that consumes
  it. Backward, each use's gradient is summed over the devices in float32
  and rounded to `round_to` on its own, and the rounded sums are added in
  `round_to` (in `uses` order), as one device adds the input gradients of
  several compute-dtype matmuls of one tensor (each rounded once, after
  its float32 accumulation). Returns a list per device of `uses` tensors.
  """
  copies = len(devices) - 1

  @tf.custom_gradient
  def _broadcast(value):
    received = _copies([value] * len(devices), devices)
    outs = []
    for copy, device in zip(received, devices):
      with tf.device(device):
        outs.extend(tf.identity(copy) for _ in range(uses))

    def grad(*upstream):
      rounded = []
      for use in range(uses):
        parts = [u for u in upstream[use::uses] if u is not None]
        if not parts:
          continue
        instrument.record("reduce", instrument.BACKWARD,
                          instrument.moved_bytes(parts[0], copies), layer)
        with tf.device(devices[0]):
          rounded.append(tf.cast(tf.add_n(parts), round_to))
      with tf.device(devices[0]):
        if not rounded:
          return tf.zeros_like(value)
        return tf.cast(tf.add_n(rounded), value.dtype)
    return outs, grad

  outs = list(_broadcast(x))
  instrument.record("broadcast", instrument.FORWARD,
                    instrument.moved_bytes(x, copies), layer, outs[-1])
  return [outs[k * uses:(k + 1) * uses] for k in range(len(devices))]


def hand_out(pieces, targets, source, layer):
  """Pieces made on `source`, piece k moved to `targets[k]`: a scatter
  whose split `source` made itself (a shared key/value head repeated for
  the query heads of the devices sharing it). Backward, each piece's
  gradient moves back to `source`.

  Args:
    pieces: tensors on `source`.
    targets: a device for each piece.
    source: the device that made them.
    layer: name for the `CommunicationLog`.

  Returns:
    The pieces, each on its target.
  """
  sizes = [instrument.moved_bytes(p, 1) for p in pieces]
  moved = None if None in sizes else sum(sizes)

  @tf.custom_gradient
  def _hand_out(*values):
    def grad(*upstream):
      instrument.record("gather", instrument.BACKWARD, moved, layer)
      with tf.device(source):
        return [tf.zeros_like(v) if u is None else tf.identity(u)
                for u, v in zip(upstream, values)]
    return _copies(values, targets), grad

  outs = list(_hand_out(*pieces))
  instrument.record("scatter", instrument.FORWARD, moved, layer, outs[-1])
  return outs


def reduce(parts, devices, layer):
  """The sum of the per-device `parts`, on the head device."""
  copies = len(devices) - 1

  @tf.custom_gradient
  def _reduce(*values):
    with tf.device(devices[0]):
      total = tf.add_n(list(values))

    def grad(upstream):
      instrument.record("broadcast", instrument.BACKWARD,
                        instrument.moved_bytes(upstream, copies), layer)
      return _copies([upstream] * len(devices), devices)
    return total, grad

  total = _reduce(*parts)
  instrument.record("reduce", instrument.FORWARD,
                    instrument.moved_bytes(parts[0], copies), layer, total)
  return total


def gather(parts, axis, devices, layer):
  """The per-device `parts` concatenated along `axis`, on the head."""
  sizes = [p.shape[axis] for p in parts]

  @tf.custom_gradient
  def _gather(*values):
    with tf.device(devices[0]):
      whole = tf.concat(list(values), axis)

    def grad(upstream):
      instrument.record("scatter", instrument.BACKWARD,
                        _remote_bytes(parts), layer)
      with tf.device(devices[0]):
        pieces = tf.split(upstream, sizes, axis)
      return _copies(pieces, devices)
    return whole, grad

  whole = _gather(*parts)
  instrument.record("gather", instrument.FORWARD, _remote_bytes(parts), layer,
                    whole)
  return whole


def scatter(x, axis, devices, layer):
  """`x` (on the head) split into equal pieces along `axis`, piece k on
  device k."""
  count = len(devices)

  @tf.custom_gradient
  def _scatter(value):
    with tf.device(devices[0]):
      pieces = tf.split(value, count, axis)

    def grad(*upstream):
      instrument.record("gather", instrument.BACKWARD,
                        _remote_bytes(pieces), layer)
      with tf.device(devices[0]):
        return tf.concat(list(upstream), axis)
    return _copies(pieces, devices), grad

  outs = list(_scatter(x))
  instrument.record("scatter", instrument.FORWARD, _remote_bytes(outs), layer,
                    outs[-1])
  return outs


def _remote_bytes(parts):
  """Bytes of the parts that live off the head (all but the first)."""
  sizes = [instrument.moved_bytes(p, 1) for p in parts[1:]]
  return None if None in sizes else sum(sizes)


def reduce_scatter(parts, axis, devices, layer):
  """The sum of the per-device `parts`, split along `axis`: piece k, the sum
  of every part's k-th piece, on device k (sequence parallelism)."""

  @tf.custom_gradient
  def _reduce_scatter(*values):
    outs = _sum_slices(values, axis, devices)

    def grad(*upstream):
      instrument.record("all-gather", instrument.BACKWARD,
                        _all_gather_bytes(upstream), layer)
      return _gather_everywhere(upstream, axis, devices)
    return outs, grad

  outs = list(_reduce_scatter(*parts))
  instrument.record("reduce-scatter", instrument.FORWARD,
                    _all_gather_bytes(outs), layer, outs[-1])
  return outs


def all_gather(pieces, axis, devices, layer):
  """The per-device `pieces` concatenated along `axis` on every device."""

  @tf.custom_gradient
  def _all_gather(*values):
    def grad(*upstream):
      instrument.record("reduce-scatter", instrument.BACKWARD,
                        _all_gather_bytes(values), layer)
      return _sum_slices(upstream, axis, devices)
    return _gather_everywhere(values, axis, devices), grad

  outs = list(_all_gather(*pieces))
  instrument.record("all-gather", instrument.FORWARD,
                    _all_gather_bytes(pieces), layer, outs[-1])
  return outs


def _sum_slices(values, axis, devices):
  """Slice k of the sum of the per-device `values`, on device k: each value
  is split on its own device and the k-th slices are added on device k."""
  slices = []
  for value, device in zip(values, devices):
    with tf.device(device):
      slices.append(tf.split(value, len(devices), axis))
  sums = []
  for k, device in enumerate(devices):
    with tf.device(device):
      sums.append(tf.add_n([s[k] for s in slices]))
  return sums


def _gather_everywhere(pieces, axis, devices):
  outs = []
  for device in devices:
    with tf.device(device):
      outs.append(tf.concat(list(pieces), axis))
  return outs


def _all_gather_bytes(pieces):
  """Bytes an all-gather (or reduce-scatter) of equal `pieces` moves: every
  device receives the t - 1 pieces it does not hold."""
  one = instrument.moved_bytes(pieces[0], 1)
  count = len(pieces)
  return None if one is None else one * count * (count - 1)
