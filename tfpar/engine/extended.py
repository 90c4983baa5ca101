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
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.util import nest

# Each strategy instance needs its own collective keys (two instances that
# share a key base fail with "Shape mismatch in the collective instance").
# Workers create their strategies in the same order, so a per-process counter
# gives every worker the same keys.
_KEY_BASE_STRIDE = 100_000
_key_bases = itertools.count(1)


def next_collective_key_base():
  """A fresh collective key base for a new strategy instance."""
  return next(_key_bases) * _KEY_BASE_STRIDE


class MeshExtended(collective_all_reduce_strategy.CollectiveAllReduceExtended):
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
    _check_replicas_inside_workers(mesh)
    self._mesh = mesh
    self._local_groups = tuple(
        group for group in mesh.replicas if mesh.is_local(group[0]))
    options = (communication_options or
               tf.distribute.experimental.CommunicationOptions())
    if mesh.cluster is not None:  # TF_CONFIG jobs, even of a single task.
      super().__init__(container_strategy,
                       cluster_resolver=mesh.cluster.cluster_resolver(),
                       communication_options=options)
    else:
      # A local mesh ignores TF_CONFIG, which TF's constructor would parse
      # again (and fail on when it is set but blank).
      with _tf_config_hidden():
        super().__init__(
            container_strategy, cluster_resolver=None,
            communication_options=options,
            devices=tuple(group[0] for group in self._local_groups))

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

  @property
  def worker_devices_by_replica(self):
    return [list(group) for group in self._local_groups]

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


def _check_replicas_inside_workers(mesh):
  if not mesh.is_multi_worker:
    return
  per_worker = mesh.cluster.devices_per_task
  if per_worker % mesh.replica_size:
    raise ValueError(
        f"Each replica spans pipeline x tensor = {mesh.replica_size} devices "
        f"but each worker has {per_worker}: a replica would cross workers, "
        f"which this strategy does not support. Use pipeline x tensor that "
        f"divides {per_worker} and put the workers on the 'data' axis.")
