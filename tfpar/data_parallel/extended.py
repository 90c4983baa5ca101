"""`DataParallelExtended`: data parallelism, with ZeRO applied by the
strategy itself when it is given one."""

import threading

import numpy as np
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat.tf_modules import resource_variable_ops
from tfpar.common import clipping
from tfpar.engine import extended as engine_extended
from tfpar.engine import materialize
from tfpar.engine import spread
from tfpar.zero import slices
from tfpar.zero import spread_slices


class DataParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.DataParallelStrategy`.

  With `zero` (a `tfpar.ZeRO`), the strategy applies it to every model
  created in its scope: under stage 3 each trainable weight is created as
  1/N slices, one per replica (`engine/spread.py`), and becomes ZeRO-3's
  slices as soon as the model is built, so no replica ever holds the whole
  model; the optimizer is sharded once the model is compiled. Across
  workers every worker draws each initial value (the same with the same
  seed) and keeps its own replicas' slices.

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
    self._gathering = threading.local()

  @property
  def zero(self):
    return self._zero

  # ZeRO-3 slices weights before Keras builds the optimizer, which a model
  # built by Keras before its first step has built for whole ones.
  refuses_unbuilt_models = True

  def spread_count(self):
    return self._mesh.num_replicas

  def spread_parts(self, pieces, name):
    """This worker's replicas' slices among `pieces` (every replica's):
    across workers each worker drew the same value with the same seed and
    keeps only its own replicas' slices."""
    parts = []
    with tf.init_scope():
      if self._mesh.is_multi_worker:  # Checked when prepared.
        self._drawn = spread.fingerprint(pieces)
      for index, group in zip(self._replica_ids(), self._local_groups):
        with tf.device(group[0]):
          # Constructed directly: the strategy's creator would mirror it.
          parts.append(resource_variable_ops.ResourceVariable(
              pieces[index], trainable=False,
              name=f"{name}_spread{index}"))
    return parts

  def _replica_ids(self):
    return slices.local_replica_ids(self._container_strategy())

  def _create_spread_variable(self, kwargs):
    created = super()._create_spread_variable(kwargs)
    if self._mesh.is_multi_worker:
      created.held_across_workers(
          self._replica_ids(), self.spread_count(),
          lambda parts: self._gather(parts, created.name))
      created.drawn = self._drawn
    return created

  def _check_same_draws(self, model):
    """Raises unless every worker drew (or assigned) the same whole value
    for each of `model`'s weights created sliced: each keeps only its own
    replicas' slices of its own draw. One all-gather of two numbers per
    weight; every worker calls it as it prepares the model."""
    pending = [(v, keras_layers.storage(v))
               for v in materialize.pending_weights(model)]
    pending = [(v, s) for v, s in pending if s.drawn is not None]
    if not self._mesh.is_multi_worker or not pending:
      return
    mine = np.concatenate([s.drawn for _, s in pending]).astype("float32")
    rows = self._gather([mine] * len(self._local_groups),
                        "initial value digests").reshape(
                            self._mesh.num_replicas, -1)
    for replica, row in enumerate(rows):
      differ = ~np.isclose(row, mine, rtol=1e-5, atol=1e-6)
      if differ.any():
        weight = pending[int(np.flatnonzero(differ)[0]) // 2][0]
        raise ValueError(
            f"DataParallelStrategy(zero=tfpar.ZeRO(stage=3)): the workers "
            f"drew different initial values for weight {weight.path!r} "
            f"(replica {replica} differs from this worker's); each worker "
            f"keeps only its replicas' slices of its own draw, so the model "
            f"would be none of them. Call keras.utils.set_random_seed(seed) "
            f"with the same seed on every worker before building the model, "
            f"or set the same weights on every worker.")

  def _gather(self, parts, name):
    """`spread_slices.gather_parts` of weights not sliced by ZeRO yet:
    the models are neither prepared nor checked while it runs."""
    self._gathering.on = True
    try:
      return spread_slices.gather_parts(self._container_strategy(), parts,
                                        name)
    finally:
      self._gathering.on = False

  def prepare_pending_models(self):
    if not getattr(self._gathering, "on", False):
      super().prepare_pending_models()

  def check_models_prepared(self):
    if not getattr(self._gathering, "on", False):
      super().check_models_prepared()

  preparation = "apply its tfpar.ZeRO"

  def is_prepared(self, model):
    if not self.spreads_weights:
      return True
    return getattr(model, "_tfpar_zero_weights", None) is not None

  def adopt_loop_optimizer(self, optimizer, model, variables):
    """A custom training loop's optimizer clips after the sum over the
    replicas, as one device clips, and is sharded under `zero=`."""
    del variables
    clipping.clip_after_all_reduce(optimizer)
    if self._zero is not None:
      self._zero.prepare_loop_optimizer(model, optimizer,
                                        self._container_strategy())

  def prepare_model(self, model):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
      clipping.clip_after_all_reduce(optimizer)
    if self._zero is None:
      return
    if model.built:
      if not self.is_prepared(model):
        self._check_same_draws(model)
      self._zero.prepare_weights(model, self._container_strategy())
    optimizer = getattr(model, "optimizer", None)
    if (optimizer is not None and not optimizer.built and
        getattr(optimizer, "_tfpar_zero", None) is None and
        (model.built or self._zero.stage != 3)):
      self._zero.prepare_fit(model)
