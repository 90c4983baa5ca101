"""`ExpertParallelStrategy`: the thin public face of
`ExpertParallelExtended` (data-only mesh) and
`ExpertTensorParallelExtended` (data x tensor mesh)."""

from tfpar.engine import strategy as engine_strategy
from tfpar.engine.per_device import checks as per_device_checks
from tfpar.expert_parallel import extended as extended_lib
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import routing
from tfpar.expert_parallel import tensor_extended
from tfpar.tensor_parallel import plan as plan_lib


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

  On a mesh with a `tensor` axis (expert x tensor), everything but the
  experts is split over each replica's tensor group as
  `TensorParallelStrategy` splits it (attention, MLPs, embeddings; `plan`
  adds rules), and each MoE layer's experts are spread over the
  `expert x tensor` devices of an expert group: whole experts,
  num_experts / (expert x tensor) of them per device (Megatron-Core's MoE
  parallel folding with expert-tensor size 1). `describe(model)` prints
  how every variable resolved.

  Args:
    mesh: a `tfpar.Mesh` with a `data` axis and optionally a `tensor` axis
      (pipeline 1; for expert x pipeline see
      `tfpar.PipelineParallelStrategy`'s `expert`).
    expert: replicas per expert group; divides the data size and every MoE
      layer's number of experts.
    capacity_factor: None: every expert takes every token routed to it
      (nothing dropped; the dispatch buffers hold num_experts x tokens
      rows). A number: each expert takes at most
      `ceil(capacity_factor * tokens * top_k / num_experts)` of a replica's
      tokens; the rest are dropped (counted by `routing_report`).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    plan: with a tensor axis, a `tfpar.ShardingPlan` (or list of rules)
      for the weights other than the experts; None: the built-in plans.
    spmd: True (the default) or None, the one design: with a tensor axis
      every device of a tensor group traces the step, tensor-parallel
      reductions are collectives of the group (as
      `TensorParallelStrategy`), and each device routes its copy of the
      tokens and exchanges its own experts' rows with the same device of
      the other replicas of its expert group (docs/expert_parallel.md).
      `spmd=False`, the retired replica-head design, is a ValueError.

  Raises:
    ValueError: a mesh with a pipeline axis, an expert size that does not
      divide the data size, a bad capacity factor, a plan without a tensor
      axis; when the model is built: experts not divisible by `expert`
      (`expert x tensor` with a tensor axis), top-k outside
      [1, num_experts], a layer the tensor plan cannot split (e.g. heads
      not divisible by the tensor size), clipping by norm with a tensor
      axis, router jitter noise with a tensor axis; `spmd=False`.

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

  On data 2 x tensor 2: attention split by heads over each tensor group,
  the experts spread over all 4 devices (one per device here):

  >>> import keras
  >>> devices = tfpar.configure_virtual_cpus(4)  # CPU-only, before TF runs.
  >>> strategy = tfpar.ExpertParallelStrategy(
  ...     tfpar.Mesh({"data": 2, "tensor": 2}), expert=2)
  >>> with strategy.scope():
  ...   tokens = keras.Input((8,), dtype="int32")
  ...   x = keras.layers.Embedding(32, 16, name="embed")(tokens)
  ...   x = x + keras.layers.MultiHeadAttention(2, 8, name="attention")(x, x)
  ...   x = x + tfpar.MoE(num_experts=4, intermediate_dim=32, name="moe")(x)
  ...   model = keras.Model(tokens, keras.layers.Dense(32, name="head")(x))
  >>> lines = strategy.describe(model, print_fn=None).splitlines()
  >>> print(lines[11].split("  ")[0], "|", lines[11].split("  ")[-1])
  moe/block/experts/gate_kernel | 0: CPU:0 | 1: CPU:1 | 2: CPU:2 | 3: CPU:3
  >>> print(lines[-4])
  split over the expert group x tensor (experts): 73.6% (6,144 of 8,352)
  """

  def __init__(self, mesh=None, expert=2, capacity_factor=None,
               communication_options=None, plan=None, spmd=True):
    per_device_checks.check_spmd(spmd, "ExpertParallelStrategy")
    routing.check_capacity_factor(capacity_factor)
    self._expert = expert
    self._capacity_factor = capacity_factor
    self._plan = None if plan is None else plan_lib.as_plan(plan)
    super().__init__(mesh, communication_options)

  def _check_mesh(self, mesh):
    if mesh.shape["pipeline"] != 1:
      raise ValueError(
          f"ExpertParallelStrategy runs on data (and tensor) axes; the mesh "
          f"has pipeline={mesh.shape['pipeline']}. For expert x pipeline "
          f"use tfpar.PipelineParallelStrategy(mesh, num_microbatches=..., "
          f"expert={self._expert!r}), which splits each stage's experts.")
    if mesh.shape["tensor"] == 1 and self._plan is not None:
      raise ValueError(
          f"plan= lays out weights over the 'tensor' axis, which this mesh "
          f"does not have (tensor=1). Received: plan={self._plan!r}")
    groups_lib.check_expert_size(self._expert, mesh.num_replicas)
    if mesh.shape["tensor"] > 1:
      per_device_checks.check_strategy(mesh)

  def _make_extended(self, mesh, communication_options):
    if mesh.shape["tensor"] > 1:
      return tensor_extended.ExpertTensorParallelExtended(
          self, mesh, self._expert, self._capacity_factor,
          plan_lib.as_plan(self._plan), communication_options)
    return extended_lib.ExpertParallelExtended(
        self, mesh, self._expert, self._capacity_factor,
        communication_options)

  @property
  def plan(self):
    """The `tfpar.ShardingPlan` of the weights other than the experts on
    a mesh with a tensor axis (None without one)."""
    if self.mesh.shape["tensor"] == 1:
      return None
    return self.extended.plan

  def describe(self, model, print_fn=print):
    """Prints how every variable of `model` is laid out on a mesh with a
    tensor axis (see `ShardingPlan.describe`): the experts' rows give the
    devices of each expert slot."""
    if self.mesh.shape["tensor"] == 1:
      raise ValueError(
          "describe() prints a data x tensor layout; this mesh has no "
          "tensor axis (every weight but the experts is replicated).")
    return self.plan.describe(model, self, print_fn=print_fn)

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
