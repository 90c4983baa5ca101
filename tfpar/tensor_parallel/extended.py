"""`TensorParallelExtended`: shards models built in its scope.

Each replica spans the devices of one `tensor` group. Shard k of a weight
is a mirrored variable on the k-th device of every replica, so the data
axis keeps it in sync exactly as it does a replicated weight, and Keras's
optimizer creates its slots next to it (`colocate_vars_with`).

Models register themselves when created in the strategy's scope (Keras's
TensorFlow trainer records the current strategy then); each is sharded once
it is built, before it first runs, is distributed data, or its optimizer
builds: when the scope is entered again (Keras does so before its symbolic
build), when a dataset is distributed and when a step runs.
"""

import contextlib
import threading
import weakref

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import values as values_lib

from tfpar import keras_hooks
from tfpar.engine import extended as engine_extended
from tfpar.tensor_parallel import layers as layers_lib
from tfpar.tensor_parallel import optimizer as optimizer_lib
from tfpar.tensor_parallel import plan as plan_lib
from tfpar.tensor_parallel import sequence as sequence_lib
from tfpar.tensor_parallel import variables as variables_lib


class _Devices:
  """A `colocate_with` stand-in that names a set of devices."""

  def __init__(self, devices):
    self._devices = tuple(devices)


class TensorParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.TensorParallelStrategy`.

  Args:
    container_strategy: the public strategy.
    mesh: the `tfpar.Mesh` (data x tensor).
    plan: a `tfpar.ShardingPlan`.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    sequence_parallel: split position-wise regions along the sequence.
  """

  def __init__(self, container_strategy, mesh, plan,
               communication_options=None, sequence_parallel=False):
    super().__init__(container_strategy, mesh, communication_options)
    self._plan = plan
    self._sequence_parallel = sequence_parallel
    self._column_ops = {}
    self._column = threading.local()
    self._models = []  # weakrefs of models created in scope.
    keras_hooks.install_model_registration()

  @property
  def plan(self):
    return self._plan

  @property
  def tensor_size(self):
    return self._mesh.shape["tensor"]

  @contextlib.contextmanager
  def tensor_shard(self, index):
    """Variables created inside go on the `index`-th device of every
    replica (shard `index` of a split weight)."""
    previous = getattr(self._column, "index", None)
    self._column.index = index
    try:
      yield
    finally:
      self._column.index = previous

  def _create_variable(self, next_creator, **kwargs):
    index = getattr(self._column, "index", None)
    if index is not None and kwargs.get("colocate_with") is None:
      kwargs["colocate_with"] = _Devices(
          group[index] for group in self._local_groups)
    return super()._create_variable(next_creator, **kwargs)

  def current_group(self):
    """The devices of the replica running now (replica 0's outside)."""
    strategy = self._container_strategy()
    context = tf.distribute.get_replica_context()
    if (context is not None and tf.distribute.has_strategy() and
        tf.distribute.get_strategy() is strategy):
      replica = tf.get_static_value(context.replica_id_in_sync_group)
      if replica is not None:
        return self._mesh.replicas[int(replica)]
    return self._local_groups[0]

  # Gradients of shard k live on the k-th devices of the replicas: reduce
  # them there with a collective of their own per column, instead of TF's
  # fallback that moves every value to the replica heads one at a time
  # ("Efficient batch_reduce is not supported if destinations are
  # different").

  def _column_of(self, value):
    """The tensor index of the devices holding a per-replica value."""
    if isinstance(value, values_lib.DistributedValues):
      device = value.values[0].device
    elif tf.is_tensor(value):
      device = value.device  # One replica per worker.
    else:
      return None
    if not device:
      return None
    spec = tf.DeviceSpec.from_string(device)
    for group in self._local_groups:
      for column, device in enumerate(group):
        if tf.DeviceSpec.from_string(device) == spec:
          return column
    return None

  def _column_cross_device_ops(self, column):
    if column not in self._column_ops:
      self._column_ops[column] = cross_device_ops_lib.CollectiveAllReduce(
          devices=[group[column] for group in self._local_groups],
          group_size=self._mesh.num_replicas,
          options=self._communication_options,
          collective_keys=self._collective_keys)
    return self._column_ops[column]

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    columns = [self._column_of(v) for v, _ in value_destination_pairs]
    if self.tensor_size == 1 or all(c in (0, None) for c in columns):
      return super()._batch_reduce_to(reduce_op, value_destination_pairs,
                                      options)
    results = [None] * len(value_destination_pairs)
    for column in dict.fromkeys(columns):
      indices = [i for i, c in enumerate(columns) if c == column]
      pairs = [value_destination_pairs[i] for i in indices]
      if column in (0, None):
        reduced = super()._batch_reduce_to(reduce_op, pairs, options)
      else:
        reduced = self._column_cross_device_ops(column).batch_reduce(
            reduce_op, pairs,
            options=self._communication_options.merge(options))
      for index, value in zip(indices, reduced):
        results[index] = value
    return results

  # Model registry and sharding.

  def register_model(self, model):
    self._models.append(weakref.ref(model))

  def shard_pending_models(self):
    """Shards every registered model that is built and not yet sharded."""
    if getattr(self._column, "sharding", False):
      return
    self._column.sharding = True
    try:
      with tf.init_scope():
        self._shard_pending_models()
    finally:
      self._column.sharding = False

  def _shard_pending_models(self):
    alive = []
    for ref in self._models:
      model = ref()
      if model is None:
        continue
      if getattr(model, "_tfpar_layouts", None) is None and model.built:
        self.shard_model(model)
      elif getattr(model, "_tfpar_layouts", None) is not None and (
          getattr(model, "optimizer", None) is not None):
        optimizer_lib.adopt(model.optimizer, model)
      alive.append(ref)
    self._models = alive

  def check_models_sharded(self):
    """Raises if a model of this strategy got built without being sharded
    (its layers would silently run replicated)."""
    for ref in self._models:
      model = ref()
      if (model is not None and model.built and
          getattr(model, "_tfpar_layouts", None) is None):
        raise ValueError(
            f"Model {model.name!r} was built while it ran, after tfpar could "
            f"shard it, so its weights would stay replicated. Build it "
            f"inside strategy.scope() before compile/fit: give it a "
            f"keras.Input, or call model.build(input_shape) or model(x).")

  def shard_model(self, model):
    """Applies the plan to a built model: splits its variables and makes
    its sharded layers compute tensor-parallel."""
    optimizer = getattr(model, "optimizer", None)
    already = tuple(
        layer._tfpar_layer_layout  # pylint: disable=protected-access
        for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
        if getattr(layer, "_tfpar_layer_layout", None) is not None)
    if already:  # Its layers belong to a model sharded before (Sequential).
      object.__setattr__(model, "_tfpar_layouts", already)
      return
    layer_layouts = plan_lib.as_plan(self._plan).resolve(
        model, self.tensor_size)
    with self._container_strategy().scope():
      for layout in layer_layouts:
        variables_lib.shard_layer(layout, self.tensor_size, self.tensor_shard)
        layers_lib.install(layout, self.current_group,
                           self._sequence_parallel)
        object.__setattr__(layout.layer, "_tfpar_layer_layout", layout)
    if self._sequence_parallel:
      sequence_lib.install(model, self.current_group)
    object.__setattr__(model, "_tfpar_layouts", layer_layouts)
    if optimizer is not None and optimizer.built:
      # Built for the unsharded weights (e.g. by keras.models.load_model):
      # move its state to a twin built for the shards.
      with self._container_strategy().scope():
        optimizer_lib.rebuild_for_shards(model)
    elif optimizer is not None:
      optimizer_lib.adopt(optimizer, model)

  # Hooks where Keras hands the strategy control before a model runs.

  def _experimental_distribute_dataset(self, dataset, options):
    self.shard_pending_models()
    return super()._experimental_distribute_dataset(dataset, options)

  def _call_for_each_replica(self, fn, args, kwargs):
    self.shard_pending_models()
    result = super()._call_for_each_replica(fn, args, kwargs)
    self.check_models_sharded()
    return result
