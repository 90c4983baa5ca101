"""ZeRO stage 3: each replica keeps 1/N of every trainable weight.

A weight's only storage becomes a slice variable (replica r holds slice r).
Inside a replica the Keras variable reads as the whole weight, all-gathered
where a layer uses it; the gather's gradient is a reduce-scatter, so the
tape hands the optimizer each replica's slice of the summed gradient.
The weights of one unit (a layer, or a run of layers that fits in
`bucket_bytes`) travel together: one all-gather and one reduce-scatter per
bucket (`buckets`); a weight read outside its unit is gathered alone.
Outside replicas (`get_weights`, saving, `assign`) the variable behaves as
the whole weight.
"""

import contextlib
import threading

import numpy as np
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat import keras_trainer
from tfpar.common import instrument
from tfpar.engine import extended as engine_extended
from tfpar.engine import spread
from tfpar.zero import buckets
from tfpar.zero import collectives
from tfpar.zero import shardable
from tfpar.zero import slices
from tfpar.zero import sparse_gradients
from tfpar.zero import spread_slices

_VARIABLE_VALUE = "VARIABLE_VALUE"
_classes = {}
_phase = threading.local()  # Set to BACKWARD while a layer is recomputed.


def current_phase():
  """`instrument.FORWARD`, or `BACKWARD` while `regather` runs a layer
  again in the backward pass (what the gathers report)."""
  return getattr(_phase, "current", instrument.FORWARD)


@contextlib.contextmanager
def phase(value):
  """Context: `current_phase()` is `value` inside."""
  previous = current_phase()
  _phase.current = value
  try:
    yield
  finally:
    _phase.current = previous


class GatheredWeight(keras_layers.WholeAssignment):
  """Mixin for a Keras variable whose storage is a ZeRO-3 slice variable."""

  def _tfpar_parts(self, column=0):
    """The components holding the slices of one component of the weight:
    all of them, or under SPMD tensor parallelism (several components per
    replica) those of one tensor column (`column`: a split weight's shard;
    a replicated weight's columns hold equal copies)."""
    parts = list(slices.components(self))
    columns = getattr(self, "_tfpar_zero_columns", 1)
    return parts if columns == 1 else parts[column::columns]

  def _tfpar_whole_tensor(self):
    if spread_slices.is_spread(self):
      return self._tfpar_whole_spread_tensor()
    parts = [c.read_value() for c in self._tfpar_parts()]
    flat = tf.concat(parts, 0)[:self.shape.num_elements()]
    return tf.reshape(flat, self.shape)

  def _tfpar_gathered(self):
    if not engine_extended.in_replica():
      return keras_layers.autocast(self, self._tfpar_whole_tensor())
    if tf.executing_eagerly():
      shardable.refuse_eager_replicas(3, f"gathers weight {self.path!r}")
    count = tf.distribute.get_replica_context().num_replicas_in_sync
    length = slices.components(self)[0].shape[0] * count
    shape, elements, path = self.shape, self.shape.num_elements(), self.path
    column = self._tfpar_zero_column
    # The gathers and reduce-scatters of this weight take fixed collective
    # keys: the process keeps no new record per key and step.
    site = getattr(self, "_tfpar_zero_site", None)
    gather_phase = current_phase()
    # Its bucket's, in its unit:
    fused = buckets.gathered(self, gather_phase)
    if fused is not None:
      return fused

    @tf.custom_gradient
    def gather(piece):
      # Under a mixed precision policy, in the layer's compute dtype, as a
      # Keras variable reads inside a layer: half the bytes of float32
      # (DeepSpeed gathers fp16 parameters the same way).
      low = keras_layers.autocast(self, piece)
      if low.dtype == tf.bfloat16:
        # CPU collectives take no bfloat16: move its bits as float16.
        whole = tf.bitcast(
            collectives.all_gather(tf.bitcast(low, tf.float16), gather_phase,
                                   path, column, site), tf.bfloat16)
      else:
        whole = collectives.all_gather(low, gather_phase, path, column, site)

      def grad(upstream):
        # The gradient is reduced in the weight's own dtype (float32).
        if isinstance(upstream, tf.IndexedSlices):  # As MirroredStrategy.
          return sparse_gradients.sliced_sparse_gradient(
              tf.cast(upstream, piece.dtype), shape, path, column,
              length // count, instrument.BACKWARD)
        return collectives.reduce_scatter(
            slices.padded_flat(tf.cast(upstream, piece.dtype), length),
            instrument.BACKWARD, path, column, site)
      return tf.reshape(whole[:elements], shape), grad
    return gather(tf.convert_to_tensor(keras_layers.storage(self)))

  def _tfpar_whole_spread_tensor(self):
    """The whole weight when its slices are spread over workers."""
    if tf.executing_eagerly():  # Every worker reads it: a collective.
      return tf.constant(self.numpy())
    if keras_trainer.in_shape_inference():  # A graph that never runs.
      return tf.zeros(self.shape, self.dtype)
    raise ValueError(
        f"Weight {self.path!r} is sharded by tfpar.ZeRO(stage=3) over "
        f"several workers; a tf.function can read it only inside the "
        f"strategy's replicas (strategy.run, fit, evaluate, predict). Read "
        f"the whole weight eagerly, on every worker, instead.")

  def __tf_tensor__(self, dtype=None, name=None):
    return tf.convert_to_tensor(self._tfpar_gathered(), dtype=dtype,
                                name=name)

  def numpy(self):
    return self._tfpar_column_numpy(0)

  def _tfpar_column_numpy(self, column):
    """Column `column`'s component of the weight, whole (NumPy): a split
    weight's shard under SPMD tensor parallelism (`ColumnPiece`)."""
    return slices.whole(self, self.shape, self._tfpar_parts(column), column)

  def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
    return np.asarray(self.numpy(), dtype=dtype)

  def assign_whole(self, value):
    if engine_extended.in_replica():
      raise ValueError(
          f"Weight {self.path!r} is sharded by tfpar.ZeRO(stage=3); only "
          f"the optimizer updates it inside a training step.")
    for column in range(getattr(self, "_tfpar_zero_columns", 1)):
      self._tfpar_assign_column(column, value)

  def _tfpar_assign_column(self, column, value):
    """Sets column `column`'s component of the weight (see
    `_tfpar_column_numpy`) to the whole `value`."""
    strategy = keras_layers.storage(self).distribute_strategy
    slices.assign_whole(self, np.asarray(value),
                        strategy.num_replicas_in_sync,
                        slices.local_replica_ids(strategy),
                        self._tfpar_parts(column))

  # tf.train.Checkpoint: the whole weight, as an unsharded model saves it.
  def _serialize_to_tensors(self):
    return {_VARIABLE_VALUE: self._tfpar_whole_tensor()}

  def _restore_from_tensors(self, restored_tensors):
    self.assign_whole(restored_tensors[_VARIABLE_VALUE])


def _gathered_class(cls):
  if cls not in _classes:
    _classes[cls] = type(f"Gathered{cls.__name__}", (GatheredWeight, cls), {})
  return _classes[cls]


def shard(model, state):
  """Replaces the storage of `model`'s trainable weights by slices.

  Args:
    model: a built Keras model under `state.strategy`.
    state: the optimizer's `ZeroState`; gets one `Entry` per weight.
  """
  with state.strategy.scope():
    for weight in model.trainable_variables:
      if isinstance(weight, GatheredWeight):
        # Sliced with another model that shares it (a Functional model
        # built on `backbone.output` after the backbone): this model's
        # optimizer updates that slice too.
        owner = weight._tfpar_zero_state  # pylint: disable=protected-access
        state.entries.setdefault(id(weight), owner.entries[id(weight)])
        continue
      column = state.column(weight)
      devices = state.weight_devices(weight)
      created = keras_layers.storage(weight)
      if isinstance(created, spread.SpreadVariable):
        # Created as this host's replicas' slices already (across workers
        # the other slices are on other workers): copied, not gathered.
        values = _spread_slices(created, state)
        created.release()  # Its creation-time slices, once read.
      else:
        values = state.weight_slices(weight)
      piece = state.new_slice(weight, "zero3", values, devices=devices,
                              trainable=True)
      keras_layers.replace_storage(weight, keras_layers.storage(piece))
      state.add_entry(weight, piece)
      weight._tfpar_zero_column = column  # pylint: disable=protected-access
      weight._tfpar_zero_columns = state.columns  # pylint: disable=protected-access
      weight._tfpar_zero_site = collectives.new_site(state.strategy)  # pylint: disable=protected-access
      weight._tfpar_zero_state = state  # pylint: disable=protected-access
      weight.__class__ = _gathered_class(type(weight))


def sliced_with(model):
  """The `ZeroState` every trainable weight of `model` was sliced into as
  part of another model that holds it (a keras-hub task model's
  backbone), or None."""
  states = [getattr(weight, "_tfpar_zero_state", None)
            for weight in model.trainable_variables]
  if states and states[0] is not None and all(
      state is states[0] for state in states):
    return states[0]
  return None


def _spread_slices(created, state):
  """This host's replicas' ZeRO-3 slices of a weight created spread over
  the replicas (`engine/spread.py`): the same cut, one slice per replica."""
  size = slices.slice_size(created.shape, state.replicas)
  if (created.count != state.replicas or
      list(created.indices) != list(state.replica_ids) or
      int(created.parts[0].shape[0]) != size):
    raise RuntimeError(
        f"tfpar: weight {created.name!r} was created as slices "
        f"{list(created.indices)} of {created.count}, but ZeRO-3 needs "
        f"slices {list(state.replica_ids)} of {state.replicas} of {size} "
        f"elements here.")
  return [part.read_value() for part in created.parts]
