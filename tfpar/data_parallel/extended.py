"""`DataParallelExtended`: data parallelism, with ZeRO applied by the
strategy itself when it is given one."""

import tensorflow as tf

from tfpar._compat.tf_modules import resource_variable_ops
from tfpar.engine import extended as engine_extended


class DataParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.DataParallelStrategy`.

  With `zero` (a `tfpar.ZeRO`), the strategy applies it to every model
  created in its scope: under stage 3 each trainable weight is created as
  1/N slices, one per replica (`engine/spread.py`), and becomes ZeRO-3's
  slices as soon as the model is built, so no replica ever holds the whole
  model; the optimizer is sharded once the model is compiled.

  Args:
    container_strategy: the public strategy.
    mesh: the `tfpar.Mesh` (data only).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    zero: None or a `tfpar.ZeRO`.
  """

  def __init__(self, container_strategy, mesh, communication_options=None,
               zero=None):
    super().__init__(container_strategy, mesh, communication_options)
    self._zero = zero
    self.spreads_weights = zero is not None and zero.stage == 3

  @property
  def zero(self):
    return self._zero

  def spread_count(self):
    return self._mesh.num_replicas

  def spread_parts(self, pieces, name):
    parts = []
    with tf.init_scope():
      for index, group in enumerate(self._local_groups):
        with tf.device(group[0]):
          # Constructed directly: the strategy's creator would mirror it.
          parts.append(resource_variable_ops.ResourceVariable(
              pieces[index], trainable=False,
              name=f"{name}_spread{index}"))
    return parts

  preparation = "apply its tfpar.ZeRO"

  def is_prepared(self, model):
    if not self.spreads_weights:
      return True
    return getattr(model, "_tfpar_zero_weights", None) is not None

  def prepare_model(self, model):
    if self._zero is None:
      return
    if model.built:
      self._zero.prepare_weights(model, self._container_strategy())
    optimizer = getattr(model, "optimizer", None)
    if (optimizer is not None and not optimizer.built and
        getattr(optimizer, "_tfpar_zero", None) is None and
        (model.built or self._zero.stage != 3)):
      self._zero.prepare_fit(model)
