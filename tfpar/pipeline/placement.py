"""Putting each stage's variables on its device in every replica."""

import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.engine import spread


def stage_column(stage_index, pipeline_size, columns_per_stage=1):
  """The first column of a replica's devices that runs stage
  `stage_index`: stages `s`, `s + p`, ... share a device (interleaved)."""
  return (stage_index % pipeline_size) * columns_per_stage


def place_stage_variables(strategy, plan, groups, pipeline_size,
                          columns_per_stage=1, skip=(), devices_of=None):
  """Re-creates every variable of stage `s` on its head device (device
  `(s % pipeline_size) x columns_per_stage`) of each replica, or on the
  devices `devices_of(that column)` gives.

  Models are built before they are cut, so their variables start on the
  replicas' head devices; each moves once, keeping its value, before the
  optimizer creates slots (which then follow it, `colocate_vars_with`).

  Args:
    strategy: the pipeline strategy.
    plan: the model's `StagePlan`.
    groups: the device group of every local replica.
    pipeline_size: the devices of a pipeline (fewer than the stages when
      each device runs several, interleaved).
    columns_per_stage: devices per stage in a replica (the tensor size).
    skip: paths of variables not to move (split over the tensor axis
      next, from where they were created).
    devices_of: None, or a function from a stage's first column to the
      devices its variables go on (under SPMD every device of the stage's
      tensor group in every replica).
  """
  if devices_of is None:
    devices_of = lambda column: tuple(group[column] for group in groups)
  # Interleaved over the stages: weights created spread over every device
  # leave each about as fast as its own arrive (engine/spread.py): `interleaved`.
  moving = {stage.index: [v for v in stage.variables if v.path not in skip]
            for stage in plan.stages}
  for index, variable in interleaved(moving, spread.nbytes):
    column = stage_column(index, pipeline_size, columns_per_stage)
    devices = devices_of(column)
    specs = tuple(tf.DeviceSpec.from_string(d) for d in devices)
    current = keras_layers.storage(variable)
    if _devices_of(current) == specs:
      continue
    value = tf.convert_to_tensor(current)
    if hasattr(current, "release"):  # Its creation-time slices.
      current.release()
    with strategy.scope(), strategy.extended.variables_on_devices(devices):
      placed = tf.Variable(
          initial_value=value, trainable=current.trainable,
          name=current.name.split(":")[0],
          synchronization=current.synchronization,
          aggregation=current.aggregation)
    keras_layers.replace_storage(variable, placed)


def _devices_of(distributed_variable):
  components = getattr(distributed_variable, "values", (distributed_variable,))
  return tuple(tf.DeviceSpec.from_string(c.device) for c in components)


def stage_devices(plan, group, pipeline_size, columns_per_stage=1):
  """The head device of every stage in one replica's group."""
  return tuple(group[stage_column(stage.index, pipeline_size,
                                  columns_per_stage)]
               for stage in plan.stages)


def interleaved(groups, size_of):
  """(key, item) pairs from `groups` ({key: [items]}), taking next from the
  group with the smallest fraction of its bytes (`size_of(item)`) taken.

  Weights created spread over every group's devices (pipeline stages) then
  leave each device about as fast as its own arrive, so no device holds
  its final share and much of the others' slices at once.

  Example:

  >>> [k for k, _ in interleaved({"a": [1, 1], "b": [2]}, lambda x: x)]
  ['a', 'b', 'a']
  """
  queues = {key: list(items) for key, items in groups.items()}
  totals = {key: max(1, sum(map(size_of, items)))
            for key, items in queues.items()}
  taken = dict.fromkeys(queues, 0)
  while any(queues.values()):
    key = min((k for k, items in queues.items() if items),
              key=lambda k: taken[k] / totals[k])
    item = queues[key].pop(0)
    taken[key] += size_of(item)
    yield key, item
