"""`ExpertParallelStrategy`: the thin public face of
`ExpertParallelExtended`."""

import numbers

from tfpar.engine import strategy as engine_strategy
from tfpar.expert_parallel import extended as extended_lib
from tfpar.expert_parallel import groups as groups_lib


class ExpertParallelStrategy(engine_strategy.MeshStrategy):
  """Expert parallelism for mixture-of-experts models, with data
  parallelism for everything else.

  As in DeepSpeed-MoE and Megatron-Core, the expert group is carved out of
  the data replicas: every `expert` consecutive data replicas hold, between
  them, each MoE layer's experts once (num_experts / expert each) and send
  each token to its experts' replica with an all-to-all (and the outputs
  back with another). Each replica sees its share of every batch, as under
  `DataParallelStrategy`; attention, embeddings and routers stay replicated
  and their gradients are summed over every replica, the experts' over
  the `data / expert` replicas that hold them. keras-hub's
  `MixtralBackbone` and `QwenMoeBackbone` are split with no code change.

  Args:
    mesh: a `tfpar.Mesh` with only a `data` axis (pipeline and tensor 1).
    expert: replicas per expert group; divides the data size and every MoE
      layer's number of experts.
    capacity_factor: None: every expert takes every token routed to it
      (nothing dropped; the dispatch buffers hold num_experts x tokens
      rows). A number: each expert takes at most
      `ceil(capacity_factor * tokens * top_k / num_experts)` of a replica's
      tokens; the rest are dropped (counted by `routing_report`).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.

  Raises:
    ValueError: a mesh with pipeline or tensor axes, an expert size that
      does not divide the data size, a bad capacity factor; when the model
      is built: experts not divisible by `expert`, top-k outside
      [1, num_experts].

  Example:

  >>> import tfpar
  >>> strategy = tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": -1}),
  ...                                         expert=1, capacity_factor=1.25)
  >>> strategy.expert, strategy.capacity_factor
  (1, 1.25)
  >>> strategy.routing_report()  # Nothing built yet.
  {}

  On 4 devices, keras-hub's Mixtral with its 4 experts split in pairs:

  >>> import keras_hub
  >>> strategy = tfpar.ExpertParallelStrategy(
  ...     tfpar.Mesh({"data": 4}), expert=2)  # doctest: +SKIP
  >>> with strategy.scope():  # doctest: +SKIP
  ...   model = keras_hub.models.MixtralBackbone(
  ...       vocabulary_size=64, num_layers=2, num_query_heads=4,
  ...       num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
  ...       num_experts=4, top_k=2)
  """

  def __init__(self, mesh=None, expert=2, capacity_factor=None,
               communication_options=None):
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool) or
        not isinstance(capacity_factor, numbers.Real) or
        not capacity_factor > 0):
      raise ValueError(
          f"capacity_factor must be None (drop nothing) or a positive "
          f"number. Received: capacity_factor={capacity_factor!r}")
    self._expert = expert
    self._capacity_factor = capacity_factor
    super().__init__(mesh, communication_options)

  def _check_mesh(self, mesh):
    for axis in ("pipeline", "tensor"):
      if mesh.shape[axis] != 1:
        raise ValueError(
            f"ExpertParallelStrategy splits experts over the 'data' axis "
            f"and does not combine with {axis} parallelism yet; the mesh "
            f"has {axis}={mesh.shape[axis]}. Put every device on 'data' "
            f"(e.g. tfpar.Mesh({{'data': {mesh.size}}})).")
    groups_lib.check_expert_size(self._expert, mesh.num_replicas)

  def _make_extended(self, mesh, communication_options):
    return extended_lib.ExpertParallelExtended(
        self, mesh, self._expert, self._capacity_factor,
        communication_options)

  @property
  def expert(self):
    """Replicas per expert group."""
    return self._expert

  @property
  def capacity_factor(self):
    return self._capacity_factor

  def routing_report(self):
    """{MoE layer path: (dropped, routed)} token-to-expert assignments
    since the strategy started (this worker's replicas; with top-k each
    token is routed k times). Nothing is dropped with
    `capacity_factor=None`."""
    return self.extended.routing_report()
