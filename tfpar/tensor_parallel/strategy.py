"""`TensorParallelStrategy`: the thin public face of
`TensorParallelExtended`."""

from tfpar.engine import strategy as engine_strategy
from tfpar.engine.per_device import checks as per_device_checks
from tfpar.tensor_parallel import extended as extended_lib
from tfpar.tensor_parallel import plan as plan_lib
from tfpar.tensor_parallel import rounding


class TensorParallelStrategy(engine_strategy.MeshStrategy):
  """Megatron-style tensor parallelism for stock Keras 3 models.

  Large weights are split over the mesh's `tensor` axis following a
  `tfpar.ShardingPlan`; the `data` axis replicates the whole arrangement.
  `num_replicas_in_sync` is the `data` size and each replica spans one
  `tensor` group; shard k of a weight lives on the k-th device of every
  replica. Models created in `strategy.scope()` are sharded when built; the
  user's model code does not change.

  Args:
    mesh: a `tfpar.Mesh` with `data` and `tensor` axes (pipeline 1).
    plan: a `tfpar.ShardingPlan`, a list of `(regex, style)` rules, or None
      for the built-in plans.
    sequence_parallel: split the LayerNorm / dropout / residual regions of
      [batch, sequence, ...] activations along the sequence over the tensor
      group (reduce-scatter and all-gather instead of reduce and
      broadcast; same bytes, 1/tensor of their activation memory per
      device).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    communication_dtype: what partial sums cross the tensor group in under
      a mixed Keras policy: `"float32"` (the default: added in float32 and
      rounded once, as one device's matmul, so training stays within stock
      Mirrored's spread from one device) or `"compute"` (the compute dtype,
      as Megatron-LM: half those bytes, each device rounding its partial
      sums before they are added). No effect under `float32`.
    zero: None, or a `tfpar.ZeRO` the strategy applies to every model
      created in its scope once it is sharded (as the callback would at
      `fit`; each tensor column's state, and with stage 3 its weights,
      sliced over the data replicas), so no callback is needed.
    spmd: True (the default) or None, the one design: every device of a tensor
      group traces its own copy of the step and computes the replicated
      work itself (LayerNorms, residual adds, dropout, the loss); the
      tensor-parallel all-reduces, reduce-scatters and all-gathers are
      collectives among the group, each device moving the ring's
      2(t-1)/t share (docs/tensor_parallel_spmd.md). `spmd=False`, the
      replica-head design, was retired and is a ValueError.

  Raises:
    ValueError: the mesh has a pipeline axis or a tensor group spanning
      workers, a bad plan or communication_dtype, `spmd=False`, or a
      setting tensor parallelism does not run (docs/tensor_parallel_spmd.md
      lists them, such as `run_eagerly=True`).

  Example:

  >>> import keras, tfpar
  >>> devices = tfpar.configure_virtual_cpus(4)  # CPU-only, before TF runs.
  >>> strategy = tfpar.TensorParallelStrategy(
  ...     tfpar.Mesh({"data": 2, "tensor": 2}))
  >>> with strategy.scope():
  ...   inputs = keras.Input((16,))
  ...   x = keras.layers.Dense(64, activation="gelu", name="up")(inputs)
  ...   model = keras.Model(inputs, keras.layers.Dense(16, name="down")(x))
  ...   model.compile(optimizer="adam", loss="mse")
  >>> print(strategy.describe(model, print_fn=lambda line: None)
  ...       .splitlines()[2])
  up/kernel    (16, 64)    ColumnParallel axis 1  (16, 32)     0: CPU:0,CPU:2 | 1: CPU:1,CPU:3
  """

  def __init__(self, mesh=None, plan=None, sequence_parallel=False,
               communication_options=None, communication_dtype="float32",
               spmd=True, zero=None):
    per_device_checks.check_spmd(spmd, "TensorParallelStrategy")
    if zero is not None and not hasattr(zero, "prepare_fit"):
      raise ValueError(
          f"TensorParallelStrategy: zero must be None or a tfpar.ZeRO "
          f"callback, e.g. zero=tfpar.ZeRO(stage=3). Received: zero={zero!r}")
    self._zero = zero
    if not isinstance(sequence_parallel, bool):
      raise ValueError(f"sequence_parallel must be True or False. Received: "
                       f"sequence_parallel={sequence_parallel!r}")
    self._float32_sums = rounding.float32_sums(communication_dtype)
    self._plan = plan_lib.as_plan(plan)
    self._sequence_parallel = sequence_parallel
    super().__init__(mesh, communication_options)

  def _make_extended(self, mesh, communication_options):
    return extended_lib.TensorParallelExtended(
        self, mesh, self._plan, communication_options,
        sequence_parallel=self._sequence_parallel,
        float32_sums=self._float32_sums, zero=self._zero)

  def _check_mesh(self, mesh):
    if mesh.shape["pipeline"] != 1:
      raise ValueError(
          f"TensorParallelStrategy runs on data x tensor meshes; this mesh "
          f"has pipeline={mesh.shape['pipeline']}. Use "
          f"tfpar.PipelineParallelStrategy for pipeline stages.")
    per_device_checks.check_strategy(mesh)

  @property
  def plan(self):
    """The `tfpar.ShardingPlan`."""
    return self._plan

  def describe(self, model, print_fn=print):
    """Prints how every variable of `model` is laid out (see
    `ShardingPlan.describe`)."""
    return self._plan.describe(model, self, print_fn=print_fn)


