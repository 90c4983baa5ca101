"""`MeshStrategy`: the thin public face of `MeshExtended`."""

import contextlib

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat.tf_modules import distribute_lib
from tfpar import keras_hooks
from tfpar import mesh as mesh_lib
from tfpar.engine import extended as extended_lib


# Subclassing MultiWorkerMirroredStrategy is what makes Keras 3 average
# metrics and concatenate predictions across workers
# (keras/src/backend/tensorflow/trainer.py, `_collective_all_reduce_multi_worker`).
class MeshStrategy(tf.distribute.MultiWorkerMirroredStrategy):
  """A `tf.distribute.Strategy` whose replicas are device groups of a mesh.

  The base of every tfpar strategy; the logic lives in `MeshExtended`.
  `num_replicas_in_sync` is the mesh's `data` size and replica `r` runs on
  `mesh.replica_devices(r)`.

  Args:
    mesh: a `tfpar.Mesh`. Default: `tfpar.Mesh.from_cluster_resolver()`,
      every device of the cluster (or of this host) on the `data` axis.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.

  Example:

  >>> import tfpar
  >>> strategy = tfpar.engine.MeshStrategy(tfpar.Mesh({"data": -1}))
  >>> strategy.num_replicas_in_sync  # doctest: +SKIP
  2
  """

  _extended_class = extended_lib.MeshExtended

  def __init__(self, mesh=None, communication_options=None):
    if mesh is None:
      mesh = mesh_lib.Mesh.from_cluster_resolver()
    if not isinstance(mesh, mesh_lib.Mesh):
      raise ValueError(
          f"{type(self).__name__} needs a tfpar.Mesh. Received: mesh={mesh!r}")
    self._check_mesh(mesh)
    keras_hooks.install_fit_preparation()  # For tfpar.ZeRO.
    self._collective_key_base = extended_lib.next_collective_key_base()
    distribute_lib.Strategy.__init__(
        self, self._make_extended(mesh, communication_options))

  def _make_extended(self, mesh, communication_options):
    return self._extended_class(self, mesh, communication_options)

  def _check_mesh(self, mesh):
    """Subclasses reject meshes they cannot run on."""
    del mesh

  @contextlib.contextmanager
  def scope(self):
    """The strategy's scope; models built inside are prepared (sharded,
    cut into stages) when it closes.

    Keras also enters it before its symbolic build (which builds the
    optimizer), and models are prepared then too, so the optimizer always
    sees the prepared variables. Nested entries do nothing extra: the user
    may be between building a model and setting its weights.
    """
    outermost = not (tf.distribute.has_strategy() and
                     tf.distribute.get_strategy() is self)
    if outermost:
      self.extended.prepare_pending_models()
    with super().scope():
      yield
    if outermost:
      self.extended.prepare_pending_models()

  def reduce(self, reduce_op, value, axis):
    # Keras 3 asks multi-worker strategies for reduce("MEAN", v, axis=0) on
    # per-replica scalars (its metrics); for a scalar that can only mean
    # "across replicas".
    return super().reduce(
        reduce_op, value, self.extended.effective_reduce_axis(value, axis))

  @property
  def mesh(self):
    """The `tfpar.Mesh` this strategy runs on."""
    return self.extended.mesh

  @property
  def cluster_resolver(self):
    return distribute.cluster_resolver(self.extended)

  def __repr__(self):
    return f"{type(self).__name__}({self.mesh!r})"
