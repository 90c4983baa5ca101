"""`tfpar.DataParallelStrategy`."""

from tfpar.data_parallel import extended as extended_lib
from tfpar.engine import strategy as engine_strategy


class DataParallelStrategy(engine_strategy.MeshStrategy):
  """Synchronous data parallelism over the `data` axis of a mesh.

  Every replica holds the whole model and a slice of each global batch;
  gradients are summed across replicas with collectives. Unlike the stock
  `MultiWorkerMirroredStrategy` under Keras 3, `model.fit` works across
  `TF_CONFIG` workers, with metrics averaged over all workers.

  Args:
    mesh: a `tfpar.Mesh` whose `pipeline` and `tensor` sizes are 1.
      Default: every device of the cluster (`TF_CONFIG`) or of this host.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    zero: None, or a `tfpar.ZeRO` the strategy applies to every model
      created in its scope (no need to pass it to `fit`). With
      `tfpar.ZeRO(stage=3)` each trainable weight is created as 1/N slices,
      one per replica, so no device ever holds the whole model: a replica
      holds 1/N of the weights plus one whole weight in transit, from the
      first weight created. Across `TF_CONFIG` workers each worker draws
      every initial value and keeps its own replicas' slices: build the
      model after `keras.utils.set_random_seed` with the same seed on every
      worker (workers that drew differently are refused when the model is
      prepared).

  Raises:
    ValueError: the mesh has `pipeline` or `tensor` larger than 1, or
      `zero` is not a `tfpar.ZeRO`.

  Example:

  >>> import keras, numpy as np, tfpar
  >>> strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": -1}))
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  ...   model.compile(optimizer="adam", loss="mse")
  >>> model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
  <...History object at ...>
  """

  def __init__(self, mesh=None, communication_options=None, zero=None):
    if zero is not None and not hasattr(zero, "prepare_weights"):
      raise ValueError(
          f"DataParallelStrategy: zero must be None or a tfpar.ZeRO "
          f"callback, e.g. zero=tfpar.ZeRO(stage=3). Received: zero={zero!r}")
    self._zero = zero
    super().__init__(mesh, communication_options)

  def _make_extended(self, mesh, communication_options):
    return extended_lib.DataParallelExtended(
        self, mesh, communication_options, zero=self._zero)

  def _check_mesh(self, mesh):
    for axis in ("pipeline", "tensor"):
      if mesh.shape[axis] != 1:
        raise ValueError(
            f"DataParallelStrategy uses only the 'data' axis, but the mesh "
            f"has {axis}={mesh.shape[axis]}. Put every device on 'data' "
            f"(e.g. tfpar.Mesh({{'data': {mesh.size}}})).")
