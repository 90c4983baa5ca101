"""`tfpar.ZeRO`: the Keras callback that turns ZeRO on for a fit."""

import keras
from tfpar import keras_hooks
from tfpar.zero import sharded_optimizer

_SUPPORTED_STAGES = (1,)


class ZeRO(keras.callbacks.Callback):
  """Shards the optimizer state over the data-parallel replicas (ZeRO-1).

  With N replicas each device keeps the optimizer state (Adam's two
  moments, and a slice of the weights it updates) of 1/N of every weight
  instead of all of it; the results are those of one device. The state is
  sharded from the start: no full-size optimizer slot is ever allocated.
  Works under `tf.distribute.MirroredStrategy`,
  `MultiWorkerMirroredStrategy` and the tfpar strategies, with every Keras
  optimizer whose state is elementwise (SGD, Adam, AdamW, RMSprop, Adagrad,
  Nadam, Adamax, Lion, ...), gradient clipping, weight decay and gradient
  accumulation.

  Args:
    stage: 1 (optimizer state). Stages 2 (gradients) and 3 (parameters)
      are not built yet and raise a ValueError.
    offload: None. CPU offload is not built yet.

  Raises:
    ValueError: an unsupported stage or offload.

  Example:

  >>> import tfpar
  >>> callback = tfpar.ZeRO(stage=1)
  >>> # model.fit(x, y, callbacks=[callback])
  """

  def __init__(self, stage=1, offload=None):
    super().__init__()
    if stage not in _SUPPORTED_STAGES:
      raise ValueError(
          f"tfpar.ZeRO supports stage=1 (optimizer state). Received: "
          f"stage={stage!r}; stages 2 and 3 are not built yet.")
    if offload is not None:
      raise ValueError(
          f"tfpar.ZeRO does not support offload yet. Received: "
          f"offload={offload!r}; use offload=None.")
    self.stage = stage
    self.offload = offload
    keras_hooks.install_fit_preparation()

  def prepare_fit(self, model):
    """Shards `model.optimizer` before `fit` builds it (called by tfpar's
    `fit` hook)."""
    optimizer = model.optimizer
    if getattr(optimizer, "_tfpar_zero", None) is None:
      sharded_optimizer.shard(optimizer, model.distribute_strategy)

  def set_model(self, model):
    super().set_model(model)
    if getattr(model.optimizer, "_tfpar_zero", None) is None:
      raise ValueError(
          "tfpar.ZeRO did not get to shard the optimizer before fit built "
          "it (fit was looked up before tfpar installed its hook). Import "
          "tfpar after keras, or create the strategy or the ZeRO callback "
          "before calling fit.")


keras_hooks.install_fit_preparation()
