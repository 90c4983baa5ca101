"""`PerDeviceRuns`: running a replica function once per device of every
tensor group (SPMD), for `PerDeviceExtended` (tensor parallelism and the
pipeline's tensor-parallel stages.

Each replica's inputs are handed to every device of its group, the
function is traced once per device in TensorFlow's mirrored replica
threads (`_compat/spmd_run.py`), and the per-device results leave as
per-replica ones: each group's first device's.
"""

import tensorflow as tf

from tfpar import watchdog
from tfpar._compat import spmd_run
from tfpar._compat.tf_modules import nest
from tfpar._compat.tf_modules import values_lib
from tfpar.engine.per_device import checks


def _is_values(value):
  return isinstance(value, values_lib.DistributedValues) and not isinstance(
      value, tf.Variable)


class PerDeviceRuns:
  """Mixin of an SPMD `StrategyExtended` (before TensorFlow's extended in
  the MRO). Needs `self._groups` (the `collectives.TensorGroups` whose
  devices the traces run on), `self._first_replica` (the global id of the
  first local replica), `tensor_size`, `_is_per_device`, and
  `_clear_memos()` (forgets what the layers memoized per trace)."""

  def _expand(self, structure):
    """Each replica's component handed to every device of its group."""
    groups, replicas = self._groups.groups, len(self._groups.groups)

    def expand(value):
      if not _is_values(value) or len(value.values) != replicas:
        return value
      components = []
      for component, group in zip(value.values, groups):
        components.append(component)
        for device in group[1:]:
          with tf.device(device):
            components.append(nest.map_structure(
                tf.identity, component, expand_composites=True))
      return values_lib.PerReplica(tuple(components))
    return nest.map_structure(expand, structure)

  def _collapse(self, structure):
    """Per-device results as per-replica ones: each group's first device."""
    t = self.tensor_size

    def collapse(value):
      if _is_values(value) and self._is_per_device(value):
        return type(value)(tuple(value.values[::t]))
      return value
    return nest.map_structure(collapse, structure)

  def check_run(self, model):
    checks.check_run(model)
    super().check_run(model)

  def _call_for_each_replica(self, fn, args, kwargs):
    return self._collapse(self.run_per_device(fn, args, kwargs))

  def run_per_device(self, fn, args=(), kwargs=None):
    """`fn` traced once per device of every local tensor group (inside a
    `tf.function`), its results left per device: `PerReplica` values of one
    component per device, replica-major (`strategy.run` keeps each group's
    first device's). A distributed argument with one component per replica
    goes to every device of the replica's group, one per device to its
    device; other values to every device.
    """
    self.prepare_pending_models()
    if tf.executing_eagerly():
      raise ValueError(
          f"{checks.EAGER_REFUSAL}. Received: an eager strategy.run; call "
          f"it inside a tf.function.")
    t = self.tensor_size
    ids = [spmd_run.DeviceReplicaId(self._first_replica + index // t, index,
                                    index % t)
           for index in range(len(self._groups.devices))]
    self._clear_memos()
    try:
      result = spmd_run.run_on_devices(
          self._container_strategy(), spmd_run.traceable(fn),
          self._expand(args or ()), self._expand(kwargs or {}),
          self._groups.devices, ids)
    finally:
      self._clear_memos()
    watchdog.touch()
    self.check_models_prepared()
    return result
