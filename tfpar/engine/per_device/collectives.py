"""Collectives among the devices of a tensor group, and Megatron's f / g.

Under SPMD every device of a data replica's tensor group traces the step
itself. Communication is then a collective of the whole group: `f` (identity
forward, all-reduce of the gradient backward) before the split projections
that share a replicated input, `g` (all-reduce forward, identity backward)
after a row-parallel projection; and, for split layers outside a
column -> row pair, `gather` (all-gather forward of a column-parallel
output) and `scatter` (local slice forward of a row-parallel input,
all-gather of its gradient backward). Each device's
collectives go through its own TensorFlow launcher, which orders them with
a per-device token (without it the traces' collectives could deadlock) and
gives the k-th collective of every device of the group the same instance
key.
"""

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import spmd_run
from tfpar._compat import traced_keys
from tfpar._compat.tf_modules import cross_device_utils
from tfpar.common import instrument


class TensorGroups:
  """One collective launcher per device of every local tensor group.

  Args:
    groups: the local replicas' device groups (each a tensor group).
    collective_keys: the strategy's `CollectiveKeys` (its key base).
    options: the strategy's `CommunicationOptions`.
    all_groups: the tensor groups of every worker (the mesh's replicas),
      in the same order on every worker; default `groups`.
  """

  def __init__(self, groups, collective_keys, options, all_groups=None):
    self.groups = tuple(tuple(g) for g in groups)
    self.tensor_size = len(self.groups[0])
    self.devices = tuple(d for g in self.groups for d in g)
    for group in self.groups:  # Collectives order members by device.
      specs = [tf.DeviceSpec.from_string(d) for d in group]
      if specs != sorted(specs, key=lambda s: (s.task or 0, s.device_index)):
        raise ValueError(
            f"Tensor parallelism needs each tensor group's "
            f"devices in TensorFlow's collective order (by device index); "
            f"this mesh has the group {list(group)}. List the mesh's "
            f"devices in index order.")
    self._launchers = []
    self.group_keys = []  # TensorFlow's group key of each tensor group.
    with tf.init_scope():
      # Across workers a group key names one group of the whole cluster:
      # every worker draws the keys of all tensor groups, in the mesh's
      # order, so that each group gets its own, the same on every worker.
      keys = {tuple(g): collective_keys.get_group_key(list(g))
              for g in (all_groups or self.groups)}
      for group in self.groups:
        key = keys[group]
        self.group_keys.append(key)
        for device in group:
          launcher = cross_device_utils.CollectiveReplicaLauncher(
              key, len(group), collective_keys, device, options)
          self._launchers.append(launcher)
    # A tensor group lies inside one worker (`setup_checks`).
    traced_keys.draw_keys_when_traced(self._launchers)

  def launcher(self, device_index):
    """The launcher of the `device_index`-th local device."""
    return self._launchers[device_index]


def current_slot():
  """The `DeviceReplicaId` of the trace running now, or None outside an
  SPMD replica."""
  return spmd_run.device_replica_id(tf.distribute.get_replica_context())


def all_reduce(groups, x, layer, phase, kind="all-reduce"):
  """Sum of `x` over the current trace's tensor group (every device gets
  it), recorded in the `CommunicationLog` with the bytes this device sends
  in a ring: 2 (t - 1) / t of `x`."""
  slot = current_slot()
  t = groups.tensor_size
  total = groups.launcher(slot.device_index).all_reduce(x)
  nbytes = instrument.moved_bytes(x, 2 * (t - 1))
  instrument.record(kind, phase, None if nbytes is None else nbytes // t,
                    layer, total)  # `total.device`: the sending device.
  return total


def _outside_replica(layer):
  if spmd_run.in_symbolic_trace():
    return True
  raise ValueError(
      f"Layer {layer!r} is split over the tensor axis of a "
      f"tensor parallelism, whose shards compute only "
      f"inside the strategy's replicas (model.fit / evaluate / predict, or "
      f"strategy.run inside a tf.function). It was called outside them.")


def f(groups, x, layer):
  """Megatron's f: `x` forward; its gradient all-reduced over the tensor
  group backward. Applied once per replicated input and trace, however
  many split projections read it (`memoized_f`)."""
  if current_slot() is None:
    _outside_replica(layer)
    return x

  @tf.custom_gradient
  def _f(value):
    def grad(dy):
      return all_reduce(groups, dy, layer, instrument.BACKWARD)
    return tf.identity(value), grad
  return _f(x)


def g(groups, x, layer):
  """Megatron's g: the sum of the group's partial results forward; the
  gradient unchanged backward."""
  if current_slot() is None:
    _outside_replica(layer)
    return x

  @tf.custom_gradient
  def _g(value):
    def grad(dy):
      return tf.identity(dy)
    return all_reduce(groups, value, layer, instrument.FORWARD), grad
  return _g(x)


def _as_bits(x):
  """bfloat16 moved as float16 bits (CPU gathers and all-to-alls take no
  bfloat16; they only copy)."""
  return tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x


def _bits_back(x, dtype):
  return tf.bitcast(x, dtype) if dtype == tf.bfloat16 else x


def _to_front(x, axis):
  axis %= x.shape.rank
  order = [axis] + [i for i in range(x.shape.rank) if i != axis]
  return tf.transpose(x, order), order


def _gather_along(groups, x, axis, layer, phase):
  """Every device's `x` concatenated along `axis` (each device sends
  (t - 1) copies of its piece around the ring: (t - 1) / t of the whole)."""
  slot = current_slot()
  front, order = _to_front(x, axis)
  gathered = _bits_back(distribute.all_gather(
      groups.launcher(slot.device_index), _as_bits(front)), x.dtype)
  instrument.record("all-gather", phase,
                    instrument.moved_bytes(x, groups.tensor_size - 1), layer,
                    gathered)
  inverse = [order.index(i) for i in range(len(order))]
  whole = tf.transpose(gathered, inverse)
  shape = x.shape.as_list()
  if shape[axis] is not None:
    shape[axis] *= groups.tensor_size
  whole.set_shape(shape)
  return whole


def _piece(groups, x, axis):
  slot = current_slot()
  return tf.split(x, groups.tensor_size, axis)[slot.tensor_index]


def gather(groups, x, axis, layer):
  """A split activation made whole on every device (a column-parallel
  output read by replicated layers): all-gather forward; backward, each
  device keeps its piece of the (replicated) gradient."""
  if current_slot() is None:
    _outside_replica(layer)
    return tf.concat([x] * groups.tensor_size, axis)

  @tf.custom_gradient
  def _gather(value):
    def grad(dy):
      return _piece(groups, dy, axis)
    return _gather_along(groups, value, axis, layer,
                         instrument.FORWARD), grad
  return _gather(x)


def scatter(groups, x, axis, layer):
  """This device's piece of a replicated activation (the input of a
  row-parallel layer no column-parallel layer feeds): a slice forward;
  backward, the pieces' gradients all-gathered."""
  if current_slot() is None:
    _outside_replica(layer)
    return tf.split(x, groups.tensor_size, axis)[0]

  @tf.custom_gradient
  def _scatter(value):
    def grad(dy):
      return _gather_along(groups, dy, axis, layer, instrument.BACKWARD)
    return _piece(groups, value, axis), grad
  return _scatter(x)


def _sum_scatter(groups, x, axis, layer, phase):
  """This device's slice along `axis` of the group's sum of `x` (CPU has
  no reduce-scatter kernel: an all-to-all of the slices, then a sum;
  each device sends (t - 1) / t of `x`)."""
  slot = current_slot()
  t = groups.tensor_size
  received = _bits_back(distribute.all_to_all(
      groups.launcher(slot.device_index),
      _as_bits(tf.stack(tf.split(x, t, axis)))), x.dtype)
  instrument.record("reduce-scatter", phase,
                    None if instrument.moved_bytes(x, t - 1) is None else
                    instrument.moved_bytes(x, t - 1) // t, layer, received)
  piece = tf.reduce_sum(received, 0)
  shape = x.shape.as_list()
  if shape[axis] is not None:
    shape[axis] //= t
  piece.set_shape(shape)
  return piece


def reduce_scatter(groups, x, axis, layer):
  """Sequence parallelism's g: the group's sum of `x`, each device keeping
  its slice along `axis`; backward, the slices' gradients all-gathered."""
  if current_slot() is None:
    _outside_replica(layer)
    return tf.split(x, groups.tensor_size, axis)[0]

  @tf.custom_gradient
  def _reduce_scatter(value):
    def grad(dy):
      return _gather_along(groups, dy, axis, layer, instrument.BACKWARD)
    return _sum_scatter(groups, value, axis, layer, instrument.FORWARD), grad
  return _reduce_scatter(x)


def all_gather(groups, x, axis, layer):
  """Sequence parallelism's f: the slices of `x` along `axis` made whole
  on every device; backward, the (partial) gradients summed and scattered
  back to their slices."""
  if current_slot() is None:
    _outside_replica(layer)
    return tf.concat([x] * groups.tensor_size, axis)

  @tf.custom_gradient
  def _all_gather(value):
    def grad(dy):
      return _sum_scatter(groups, dy, axis, layer, instrument.BACKWARD)
    return _gather_along(groups, value, axis, layer,
                         instrument.FORWARD), grad
  return _all_gather(x)


def summed_by_first_sharer(groups, y, sharers, layer):
  """A key or value head that `sharers` consecutive devices of the group
  each compute (fewer key/value heads than devices): `y` forward;
  backward, the first of them takes the sum of their gradients, in float32
  rounded once, and the others zero, as one device adds a repeated head's
  gradients before taking its one kernel gradient."""
  if current_slot() is None:
    _outside_replica(layer)
    return y

  @tf.custom_gradient
  def _summed(value):
    def grad(dy):
      index = current_slot().tensor_index
      everyone = _gather_along(groups, dy[None], 0, layer,
                               instrument.BACKWARD)
      first = index // sharers * sharers
      if index != first:
        return tf.zeros_like(dy)
      total = tf.reduce_sum(
          tf.cast(everyone[first:first + sharers], tf.float32), axis=0)
      return tf.cast(total, dy.dtype)
    return tf.identity(value), grad
  return _summed(y)


def group_max(groups, x, layer):
  """The elementwise maximum of `x` over the tensor group (an all-gather
  of every device's `x`; no gradient): the whole input's quantization
  range of a row-parallel int8 layer."""
  if current_slot() is None:
    _outside_replica(layer)
    return x
  everyone = _gather_along(groups, tf.stop_gradient(x)[None], 0, layer,
                           instrument.FORWARD)
  return tf.reduce_max(everyone, axis=0)
