"""`tfpar.DataParallelStrategy`."""

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

  Raises:
    ValueError: the mesh has `pipeline` or `tensor` larger than 1.

  Example:

  >>> import keras, numpy as np, tfpar
  >>> strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": -1}))
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  ...   model.compile(optimizer="adam", loss="mse")
  >>> model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
  <keras.src.callbacks.history.History object at ...>
  """

  def _check_mesh(self, mesh):
    for axis in ("pipeline", "tensor"):
      if mesh.shape[axis] != 1:
        raise ValueError(
            f"DataParallelStrategy uses only the 'data' axis, but the mesh "
            f"has {axis}={mesh.shape[axis]}. Put every device on 'data' "
            f"(e.g. tfpar.Mesh({{'data': {mesh.size}}})).")
