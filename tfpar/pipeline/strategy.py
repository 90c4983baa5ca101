"""`PipelineParallelStrategy`: the thin public face of
`PipelineParallelExtended`."""

import numbers
import warnings

from tfpar import mesh as mesh_lib
from tfpar.engine import strategy as engine_strategy
from tfpar.engine import training_summary
from tfpar.engine.per_device import checks as per_device_checks
from tfpar.pipeline import cross_worker
from tfpar.pipeline import expert_extended
from tfpar.pipeline import experts
from tfpar.pipeline import extended as extended_lib
from tfpar.pipeline import placement
from tfpar.pipeline import schedules
from tfpar.pipeline import tensor_stages
from tfpar.tensor_parallel import plan as plan_lib
from tfpar.tensor_parallel import rounding as tensor_rounding


class PipelineParallelStrategy(engine_strategy.MeshStrategy):
  """GPipe, 1F1B and interleaved 1F1B pipeline parallelism for stock Keras
  3 models.

  A `Sequential` model, or a Functional model that is a chain of blocks,
  created in `strategy.scope()` is cut into `pipeline` stages when built;
  stage s, its variables and optimizer state live on the s-th pipeline
  device of every replica. Each replica batch is split into
  `num_microbatches` micro-batches that flow through the stages in the
  schedule's order. `num_replicas_in_sync` is the mesh's `data` size.
  `fit`, `evaluate` and `predict` give the results of one device.

  With a `tensor` axis the stages are tensor-parallel (3D parallelism,
  `data x pipeline x tensor`): stage s spans devices
  `s * tensor .. s * tensor + tensor - 1` of every replica, and its layers
  are split over them by `plan`, as `tfpar.TensorParallelStrategy` splits
  a whole model.

  Stages may sit on different `TF_CONFIG` workers (a mesh whose pipeline
  crosses workers, data 1): the chief drives the pipeline and places
  stages on the other workers' devices. On the other workers this
  constructor serves their devices and ends the process once the chief
  is done, so code after it runs on the chief only.

  Args:
    mesh: a `tfpar.Mesh` with a `pipeline` axis (and optionally `data`
      and `tensor`).
    num_microbatches: micro-batches per replica batch (m). The bubble is
      (p - 1) / (m + p - 1); use m >= 4p.
    schedule: `"1f1b"` (one forward, one backward: at most p micro-batches
      of activations alive per stage), `"gpipe"` (all forwards, then all
      backwards: m alive) or `"interleaved"` (Megatron-LM's interleaved
      1F1B: the model is cut into `virtual_stages x p` stages, device d
      runs stages d, d + p, ...; bubble (p - 1) / (v m + p - 1); m must
      be a multiple of p).
    stages: `"auto"` to balance the stages' estimated costs, or the names
      of the layers that start stages 1 .. v p - 1.
    recompute: keep only each stage's input in the forward and recompute
      the stage in its backward (less activation memory, one more forward).
    virtual_stages: stages per pipeline device, v (`"interleaved"` only,
      at least 2).
    communication_dtype: with a `tensor` axis, what tensor-parallel stages
      add partial sums in under a mixed policy: `"float32"` (the default)
      or `"compute"` (see `tfpar.TensorParallelStrategy`).
    plan: with a `tensor` axis, how the stages' layers are split: a
      `tfpar.ShardingPlan`, a list of `(regex, style)` rules, or None for
      the built-in plans (see `tfpar.TensorParallelStrategy`).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    expert: None, or expert x pipeline: the mixture-of-experts layers'
      experts (keras-hub's Mixtral and Qwen-MoE blocks, `tfpar.MoE`) are
      split over groups of `expert` consecutive data replicas, on their
      stage's devices: each holds num_experts / expert of a layer's
      experts, and tokens reach them with all-to-alls among the stage's
      devices (see `tfpar.ExpertParallelStrategy`). Divides the data size.
    capacity_factor: with `expert`, None (drop nothing) or a positive
      number bounding each expert's tokens per micro-batch (see
      `tfpar.ExpertParallelStrategy`).
    spmd: None (the default) or True, the one design: with a `tensor`
      axis each replica's step is traced once per tensor column, that
      trace running the whole schedule on its column of every stage, so a
      stage's tensor-parallel reductions are collectives of its tensor
      group and every device of it does the replicated work (as
      `tfpar.TensorParallelStrategy`), on one worker or across
      `TF_CONFIG` workers (docs/three_d.md). `spmd=False`, the retired
      replica-head design, is a ValueError.

  Raises:
    ValueError: a bad schedule, stages, num_microbatches or plan, a plan
      without a `tensor` axis, `spmd=False`, or tensor-parallel stages
      across workers;
      with `expert`: an expert size that does not divide the data size, a
      tensor axis, a mesh across workers, `"interleaved"`, `recompute`;
      when the model is built, experts not divisible by `expert`.

  Example:

  >>> import keras, tfpar
  >>> devices = tfpar.configure_virtual_cpus(4)  # CPU-only, before TF runs.
  >>> strategy = tfpar.PipelineParallelStrategy(
  ...     tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=4)
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((8,))] + [
  ...       keras.layers.Dense(8, name=f"d{i}") for i in range(4)])
  ...   model.compile(optimizer="adam", loss="mse")
  >>> print(strategy.describe_stages(model, print_fn=None).splitlines()[2])
  0      2       d0 .. d1       50.0%  144     /job:localhost/replica:0/task:0/device:CPU:0

  Expert x pipeline: each stage's experts split over expert groups of 2
  replicas (here one group), on the stage's devices:

  >>> strategy = tfpar.PipelineParallelStrategy(
  ...     tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2,
  ...     schedule="gpipe", expert=2)
  >>> with strategy.scope():
  ...   tokens = keras.Input((4,), dtype="int32")
  ...   x = keras.layers.Embedding(16, 8, name="embed")(tokens)
  ...   x = tfpar.MoE(num_experts=4, intermediate_dim=8, name="moe0")(x)
  ...   x = tfpar.MoE(num_experts=4, intermediate_dim=8, name="moe1")(x)
  ...   model = keras.Model(tokens, keras.layers.Dense(16, name="head")(x))
  >>> row = [line for line in strategy.describe(model, print_fn=None)
  ...        .splitlines() if line.startswith("moe1/block/experts/up")][0]
  >>> print(row.split("  ")[-1])
  0: CPU:1 | 1: CPU:3
  """

  def __init__(self, mesh=None, num_microbatches=None, schedule="1f1b",
               stages="auto", recompute=False, plan=None,
               communication_options=None, virtual_stages=1,
               communication_dtype="float32", expert=None,
               capacity_factor=None, spmd=None):
    experts.check_options(expert, capacity_factor, schedule, recompute)
    per_device_checks.check_spmd(spmd, "PipelineParallelStrategy")
    self._expert = expert
    self._capacity_factor = capacity_factor
    if (not isinstance(num_microbatches, numbers.Integral) or
        isinstance(num_microbatches, bool) or num_microbatches < 1):
      raise ValueError(
          f"num_microbatches must be a positive integer. Received: "
          f"num_microbatches={num_microbatches!r}")
    schedules.check_interleaving(schedule, virtual_stages, 1, None)
    self._float32_sums = tensor_rounding.float32_sums(communication_dtype)
    if stages != "auto" and (
        isinstance(stages, str) or
        not all(isinstance(name, str) for name in stages)):
      raise ValueError(f"stages must be 'auto' or a list of layer names. "
                       f"Received: stages={stages!r}")
    if not isinstance(recompute, bool):
      raise ValueError(f"recompute must be True or False. Received: "
                       f"recompute={recompute!r}")
    self._options = (int(num_microbatches), schedule,
                     stages if stages == "auto" else tuple(stages), recompute,
                     virtual_stages)
    self._plan = None if plan is None else plan_lib.as_plan(plan)
    if mesh is None:
      mesh = mesh_lib.Mesh.from_cluster_resolver()
    if isinstance(mesh, mesh_lib.Mesh) and expert is not None:
      experts.check_mesh(mesh, expert)  # Before other workers serve.
    if isinstance(mesh, mesh_lib.Mesh) and cross_worker.crosses_workers(mesh):
      if mesh.shape["tensor"] > 1:
        raise ValueError(
            f"Tensor-parallel stages (tensor={mesh.shape['tensor']}) need "
            f"each pipeline inside one worker: put the workers on the 'data' "
            f"axis (pipeline x tensor dividing the devices per worker).")
      if schedule == "interleaved":
        raise ValueError(
            "schedule='interleaved' runs inside one worker: put the workers "
            "on the 'data' axis, or use '1f1b' or 'gpipe' for a pipeline "
            "across workers.")
      mesh = cross_worker.driver_mesh(mesh)  # Other workers serve, then exit.
    super().__init__(mesh, communication_options)
    stages_count = self.mesh.shape["pipeline"]
    if num_microbatches < stages_count:
      warnings.warn(
          f"num_microbatches={num_microbatches} is fewer than the "
          f"{stages_count} pipeline stages: the expected bubble is "
          f"{self.expected_bubble:.0%} "
          f"of the step (p - 1) / (m + p - 1). Use at least "
          f"{4 * stages_count} micro-batches (4 x stages).", stacklevel=2)

  def _make_extended(self, mesh, communication_options):
    num_microbatches, schedule, stages, recompute, virtual_stages = (
        self._options)
    options = dict(
        num_microbatches=num_microbatches, schedule=schedule, stages=stages,
        recompute=recompute, virtual_stages=virtual_stages,
        plan=plan_lib.as_plan(self._plan),
        communication_options=communication_options,
        float32_sums=self._float32_sums)
    if self._expert is not None:
      return expert_extended.ExpertPipelineExtended(
          self, mesh, self._expert, self._capacity_factor, **options)
    if mesh.shape["tensor"] > 1:
      return tensor_stages.TensorStagesExtended(self, mesh, **options)
    return extended_lib.PipelineParallelExtended(self, mesh, **options)

  def _check_mesh(self, mesh):
    num_microbatches, schedule, _, _, virtual_stages = self._options
    schedules.check_interleaving(schedule, virtual_stages,
                                 mesh.shape["pipeline"], num_microbatches)
    if self._plan is not None and mesh.shape["tensor"] == 1:
      raise ValueError(
          "plan splits layers over the mesh's tensor axis, but this mesh has "
          "tensor=1. Add a tensor axis (e.g. tfpar.Mesh({'pipeline': 2, "
          "'tensor': 2})) or leave plan=None.")

  @property
  def expert(self):
    """Replicas per expert group (None: experts are not split)."""
    return self._expert

  @property
  def capacity_factor(self):
    """None (nothing dropped) or the bound on each expert's tokens per
    micro-batch (with `expert`)."""
    return self._capacity_factor

  def routing_report(self):
    """{MoE layer path: (dropped, routed)} token-to-expert assignments
    since the strategy started (with `expert`; see
    `tfpar.ExpertParallelStrategy.routing_report`)."""
    if self._expert is None:
      raise ValueError("routing_report() reports the routing of split "
                       "experts; this strategy has expert=None.")
    return self.extended.routing_report()

  @property
  def num_microbatches(self):
    """Micro-batches per replica batch."""
    return self.extended.num_microbatches

  @property
  def schedule(self):
    """`"gpipe"`, `"1f1b"` or `"interleaved"`."""
    return self.extended.schedule

  @property
  def virtual_stages(self):
    """Stages per pipeline device (more than 1 under `"interleaved"`)."""
    return self.extended.virtual_stages

  @property
  def expected_bubble(self):
    """The ideal bubble fraction (p - 1) / (v m + p - 1) of this setting."""
    return schedules.bubble_fraction(self.mesh.shape["pipeline"],
                                     self.num_microbatches,
                                     self.virtual_stages)

  def describe(self, model, print_fn=print):
    """Prints (and returns) how every variable of `model` is laid out: its
    style under the tensor-parallel plan and the devices of each shard,
    inside its stage's tensor group (see `tfpar.ShardingPlan.describe`).

    Args:
      model: a built model created in this strategy's scope.
      print_fn: where to print lines; None to only return the text.

    Example:

    >>> import keras, tfpar
    >>> strategy = tfpar.PipelineParallelStrategy(
    ...     tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=4)
    >>> with strategy.scope():  # doctest: +SKIP
    ...   model = build_model()
    >>> strategy.describe(model)  # doctest: +SKIP
    """
    plan = plan_lib.as_plan(self._plan)
    return plan.describe(model, self, print_fn=print_fn)

  def describe_stages(self, model, print_fn=print):
    """Prints (and returns) how `model` is cut: each stage's layers, share
    of the estimated cost, parameter count and devices (replica 0; with a
    `tensor` axis, the stage's tensor group), then the dtype policy and
    gradient accumulation.

    Args:
      model: a built model created in this strategy's scope.
      print_fn: where to print lines; None to only return the text.
    """
    plan = getattr(model, "_tfpar_stage_plan", None)
    if plan is None:
      plan = self.extended.stage_plan(model)
    devices = self.mesh.replica_devices(0)
    tensor, pipeline = self.mesh.shape["tensor"], self.mesh.shape["pipeline"]
    columns = [placement.stage_column(s, pipeline, tensor)
               for s in range(len(plan))]
    text = plan.describe([" ".join(devices[c:c + tensor]) for c in columns])
    text += "\n" + training_summary.training_line(model)
    if print_fn is not None:
      print_fn(text)
    return text
