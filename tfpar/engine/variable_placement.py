"""Where `MeshExtended` puts the variables created in its scope.

By default a variable gets one component on each replica's head device
(TensorFlow's mirrored variable). Inside `variables_on_column(k)` it goes
on the k-th device of every replica (a tensor shard, a pipeline stage);
inside `variables_on_devices(...)` on the devices named; and a strategy
that splits weights creates each model weight spread in slices
(`engine/spread.py`) until its layout is known.
"""

import contextlib
import threading

import tensorflow as tf

from tfpar import watchdog
from tfpar.engine import spread


class DeviceSet:
  """The `colocate_with` of a variable creation that names its devices.

  `VariablePlacement._create_variable` passes one for
  `variables_on_column`; the variable gets one component per device (one
  per replica).

  Args:
    devices: device names, one per local replica.
  """

  def __init__(self, devices):
    self._devices = tuple(devices)


class VariablePlacement:
  """Mixin of `MeshExtended`: variable creation on mesh devices."""

  # Strategies that split weights create them spread (`engine/spread.py`)
  # and lay them out when the model is prepared.
  spreads_weights = False

  def _init_variable_placement(self):
    self._column = threading.local()

  @contextlib.contextmanager
  def variables_on_column(self, index):
    """Variables created inside go on the `index`-th device of every
    replica (a tensor shard, a pipeline stage) instead of its head."""
    previous = getattr(self._column, "index", None)
    self._column.index = index
    try:
      yield
    finally:
      self._column.index = previous

  @contextlib.contextmanager
  def variables_on_devices(self, devices):
    """Variables created inside get one component on each of `devices`
    (a pipeline stage's devices under SPMD: every device of its tensor
    group in every replica, replica-major)."""
    previous = getattr(self._column, "devices", None)
    self._column.devices = tuple(devices)
    try:
      yield
    finally:
      self._column.devices = previous

  def placed_by_caller(self, kwargs):
    """Whether a variable creation says where it goes: its
    `colocate_with`, or `variables_on_column` / `variables_on_devices`
    around it."""
    return (kwargs.get("colocate_with") is not None or
            getattr(self._column, "index", None) is not None or
            getattr(self._column, "devices", None) is not None)

  def _create_variable(self, next_creator, **kwargs):
    index = getattr(self._column, "index", None)
    devices = getattr(self._column, "devices", None)
    if devices is not None and kwargs.get("colocate_with") is None:
      kwargs["colocate_with"] = DeviceSet(devices)
    elif index is not None and kwargs.get("colocate_with") is None:
      kwargs["colocate_with"] = DeviceSet(
          group[index] for group in self._local_groups)
    elif self.spreads_weights and spread.should_spread(kwargs):
      return self._create_spread_variable(kwargs)
    # Across workers the chief broadcasts every initial value.
    with watchdog.watching(self._container_strategy(),
                           f"the creation of variable {kwargs.get('name')!r}"):
      return super()._create_variable(next_creator, **kwargs)

  def spread_count(self):
    """How many slices a spread weight has: one per device of a replica."""
    return self._mesh.replica_size

  def spread_parts(self, pieces, name):
    """The slice variables of a spread weight: piece k on the k-th device
    of every replica (mirrored over the data axis)."""
    parts = []
    for index, piece in enumerate(pieces):
      with self.variables_on_column(index):
        parts.append(tf.Variable(piece, trainable=False,
                                 name=f"{name}_spread{index}"))
    return parts

  def _validate_colocate_with_variable(self, colocate_with_variable):
    # An optimizer built before the model is prepared (load_model) puts its
    # slots beside spread weights: on the replica heads, until prepared.
    if isinstance(colocate_with_variable, spread.SpreadVariable):
      return
    super()._validate_colocate_with_variable(colocate_with_variable)

  def _create_spread_variable(self, kwargs):
    value = spread.initial_tensor(kwargs, self._local_groups[0][0])
    name = kwargs.get("name") or "Variable"
    pieces = spread.flat_pieces(value, self.spread_count())
    parts = self.spread_parts(pieces, name)
    creation = {k: kwargs[k] for k in (
        "dtype", "trainable", "name", "aggregation", "synchronization")
                if kwargs.get(k) is not None}
    creation["dtype"] = value.dtype
    return spread.SpreadVariable(
        value.shape, value.dtype, name, parts, creation,
        self._container_strategy(), (g[0] for g in self._local_groups))
