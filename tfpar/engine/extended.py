"""`MeshExtended`: the strategy engine every tfpar strategy builds on.

A replica is a group of mesh devices (`pipeline x tensor`), as a TPU replica
is a group of logical cores; `num_replicas_in_sync` is the `data` size. Each
replica's first device is its *head*: it receives the replica's input, holds
the replica's copy of unsharded variables and takes part in the cross-replica
collectives. Keras's loss scaling (1 / num_replicas_in_sync), its gradient
all-reduce, metrics and predict then stay correct unchanged.

The engine extends TF's `CollectiveAllReduceExtended`, so the same code runs
on one host and across `TF_CONFIG` workers, and fixes what stops Keras 3
`model.fit` there (keras-team/keras#20585): reducing a nested structure of
per-replica values across workers.
"""

import contextlib
import itertools
import os

import tensorflow as tf

from tfpar import batches
from tfpar import keras_hooks
from tfpar import timeouts as timeouts_lib
from tfpar import watchdog
from tfpar._compat import custom_gradients
from tfpar._compat import distribute
from tfpar._compat import keras_optimizer_hooks
from tfpar._compat import side_effects
from tfpar._compat import traced_keys
from tfpar._compat.tf_modules import collective_all_reduce_strategy
from tfpar._compat.tf_modules import nest
from tfpar._compat.tf_modules import values_lib
from tfpar.common import strategy_hooks
from tfpar.engine import bfloat16_gather
from tfpar.engine import column_reductions
from tfpar.engine import merge_free
from tfpar.engine import prepared_models
from tfpar.engine import setup_checks
from tfpar.engine import variable_placement

# Each strategy instance needs its own collective keys (two instances that
# share a key base fail with "Shape mismatch in the collective instance").
# Workers create their strategies in the same order, so a per-process counter
# gives every worker the same keys.
_KEY_BASE_STRIDE = 100_000
_key_bases = itertools.count(1)


def next_collective_key_base():
  """A fresh collective key base for a new strategy instance."""
  return next(_key_bases) * _KEY_BASE_STRIDE


class MeshExtended(variable_placement.VariablePlacement,
                   merge_free.MergeFreeUpdates, bfloat16_gather.Bfloat16Gather,
                   prepared_models.PreparedModels,
                   column_reductions.ColumnReductions,
                   strategy_hooks.StrategyHooks,
                   collective_all_reduce_strategy.CollectiveAllReduceExtended):
  """Strategy engine over a `tfpar.Mesh`: replicas are device groups.

  Args:
    container_strategy: the public `tf.distribute.Strategy` object.
    mesh: the `tfpar.Mesh` to run on.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.

  Raises:
    ValueError: a replica would span several workers.
  """

  def __init__(self, container_strategy, mesh, communication_options=None):
    setup_checks.check_replicas_inside_workers(mesh)
    setup_checks.check_not_tpu(mesh)
    self._mesh = mesh
    self._init_prepared_models()
    self._init_column_reductions()
    self._init_variable_placement()
    keras_hooks.install_model_registration()
    keras_hooks.install_optimizer_adoption()
    keras_hooks.install_run_hooks()
    keras_hooks.install_symbolic_build_batch()
    keras_optimizer_hooks.install_accumulation_without_merge_call()
    keras_optimizer_hooks.install_global_overflow_check()
    custom_gradients.hold_custom_gradients_on_their_graphs()
    self._init_merge_free()
    self._local_groups = tuple(
        group for group in mesh.replicas if mesh.is_local(group[0]))
    options = (communication_options or
               tf.distribute.experimental.CommunicationOptions())
    self.timeouts = None  # Bounded waits of a multi-worker job.
    if mesh.is_multi_worker:
      self.timeouts = timeouts_lib.Timeouts.from_environment()
      timeouts_lib.configure_coordination(mesh.cluster, self.timeouts)
      watchdog.install()
    if mesh.cluster is not None:  # TF_CONFIG jobs, even of a single task.
      setup_checks.reuse_running_server(self, mesh.cluster)
      try:
        super().__init__(container_strategy,
                         cluster_resolver=mesh.cluster.cluster_resolver(),
                         communication_options=options)
      except tf.errors.DeadlineExceededError as error:
        clear = self.timeouts and timeouts_lib.connect_error(
            error, mesh.cluster, self.timeouts)
        if clear is None:
          raise
        raise clear from error
    else:
      # A local mesh ignores TF_CONFIG, which TF's constructor would parse
      # again (and fail on when it is set but blank).
      with _tf_config_hidden():
        super().__init__(
            container_strategy, cluster_resolver=None,
            communication_options=options,
            devices=tuple(group[0] for group in self._local_groups))
    if not mesh.is_multi_worker:
      traced_keys.draw_keys_when_traced(distribute.launchers(
          distribute.strategy_collective_ops(self)))

  # Called by CollectiveAllReduceExtended._initialize_multi_worker.
  def _initialize_local_devices(self, cluster_resolver, worker_device):
    del cluster_resolver, worker_device
    heads = tuple(group[0] for group in self._local_groups)
    return heads, self._mesh.cluster.device_type

  @property
  def mesh(self):
    return self._mesh

  @property
  def replica_device_groups(self):
    """The device group of every replica of this worker, in replica order."""
    return self._local_groups

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

  @property
  def worker_devices_by_replica(self):
    return [list(group) for group in self._local_groups]

  checks_batch_size = True

  def adopt_optimizer(self, optimizer, variables):
    """An optimizer a model was compiled with is prepared with its model
    (`prepare_model`); any other is a custom training loop's, prepared by
    `adopt_loop_optimizer`. Returns the weights to build it for when the
    model's preparation (here, before the build) replaced `variables`."""
    if getattr(self._preparing, "active", False):
      return None  # A twin tfpar builds while it prepares a model.
    for model in self.registered_models():
      compiled = getattr(model, "optimizer", None)
      if any(optimizer is o for o in (
          compiled, getattr(compiled, "inner_optimizer", None))):
        return None  # Left to Keras, as before any loop of one's own.
    if not in_replica():
      with self._container_strategy().scope():
        self.prepare_pending_models()
    model, weights = self.model_of(variables)
    self.adopt_loop_optimizer(optimizer, model, variables)
    return weights

  def adopt_loop_optimizer(self, optimizer, model, variables):
    """Prepares `optimizer`, built by a custom training loop to train
    `model` (None: `variables` are not all one model's). Refused here if
    any of `variables` is (or was, before the model was prepared) a
    weight of a model created in the scope; other variables are left as
    they are. The data-parallel and tensor-parallel strategies override
    it."""
    if model is None and not any(
        self.model_of([variable])[0] is not None for variable in variables):
      return
    raise ValueError(
        f"{type(self._container_strategy()).__name__} prepares the "
        f"optimizer a model is compiled with (model.compile(optimizer=...)) "
        f"for fit, evaluate and predict; optimizer {optimizer.name!r} is "
        f"being built by a custom training loop (optimizer.apply or "
        f"apply_gradients outside fit), which tfpar supports under "
        f"DataParallelStrategy and TensorParallelStrategy. Compile the "
        f"model with it and train with fit (override train_step for a step "
        f"of your own).")

  def steps_loop_refusal(self):
    """In one process, the steps' collectives draw their instance keys
    when a step is traced (`_compat.traced_keys`); across workers they
    take a new key at every call, which TensorFlow cannot feed into
    Keras's loop."""
    if self._mesh.is_multi_worker:
      return ("collectives between workers take a new instance key at "
              "every call, which TensorFlow cannot feed into Keras's loop "
              "(stock MultiWorkerMirroredStrategy fails the same way)")
    return None

  def check_batch_size(self, batch_size, what="batch_size"):
    """Raises unless `batch_size` splits evenly over the data replicas
    (`fit`, `evaluate` and `predict` call it first; `tfpar.batches`)."""
    batches.check_even_split(batch_size, self._mesh.num_replicas, what)

  # Counted so that `keras_hooks` knows a run that raised left input
  # iterators for Python's collector.
  datasets_distributed = 0

  def _experimental_distribute_dataset(self, dataset, options):
    self.prepare_pending_models()
    self.datasets_distributed += 1
    return super()._experimental_distribute_dataset(dataset, options)

  def _call_for_each_replica(self, fn, args, kwargs):
    self.prepare_pending_models()
    graph = None if tf.executing_eagerly() else (
        tf.compat.v1.get_default_graph())
    first_op = graph.num_operations() if graph is not None else 0
    result = super()._call_for_each_replica(fn, args, kwargs)
    if graph is not None:  # The replica threads' ops interleave.
      side_effects.order_per_replica(graph, first_op, self._local_groups)
    watchdog.touch()  # Tracing a step is not waiting for the peers.
    self.check_models_prepared()
    return result

  def effective_reduce_axis(self, value, axis):
    """`axis`, or None when every per-replica component is a scalar."""
    if axis is None:
      return None
    components = self._local_results(value) if isinstance(
        value, values_lib.DistributedValues) else (value,)
    if all(getattr(c, "shape", None) is not None and c.shape.rank == 0
           for c in components):
      return None
    return axis

  def symbolic_build_batch(self, batch):
    """The batch Keras builds a model from before `fit`, `evaluate` or
    `predict` (`keras_hooks.install_symbolic_build_batch`): the first
    local replica's part of each distributed value of `batch`.

    Keras reads only shapes and dtypes from it; its own
    `reduce("MEAN", batch)` fails on boolean masks, averages token ids and
    runs a collective across workers for nothing.
    """
    return nest.map_structure(
        lambda value: (self._local_results(value)[0] if isinstance(
            value, values_lib.DistributedValues) else value), batch)

  def _reduce_to(self, reduce_op, value, destinations, options):
    # Keras's symbolic build reduces a whole (x, y, sample_weight) batch at
    # once; the collective path accepts one DistributedValues only.
    if (not isinstance(value, values_lib.DistributedValues) and
        nest.is_nested(value)):
      return nest.map_structure(
          lambda v: self._reduce_to(reduce_op, v, destinations, options),
          value)
    return super()._reduce_to(reduce_op, value, destinations, options)


@contextlib.contextmanager
def _tf_config_hidden():
  saved = os.environ.pop("TF_CONFIG", None)
  try:
    yield
  finally:
    if saved is not None:
      os.environ["TF_CONFIG"] = saved


def in_replica():
  """Whether a replica function runs now (`strategy.run`), as opposed to
  a strategy's scope or no strategy at all.

  Example:

  >>> from tfpar.engine.extended import in_replica
  >>> in_replica()
  False
  """
  return (tf.distribute.has_strategy() and
          not tf.distribute.in_cross_replica_context())
