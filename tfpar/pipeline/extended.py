"""`PipelineParallelExtended`: cuts models into stages and pipelines them.

Each replica spans the mesh's `pipeline x tensor` devices; stage s of a
model lives on devices s x tensor .. (s + 1) x tensor - 1 of every replica
(its variables and, through Keras's `colocate_vars_with`, its optimizer
slots). With a `tensor` axis each stage's layers are split over its
devices by the sharding plan, as tensor parallelism splits a whole model
(3D parallelism, `tensor_stages.py`). Keras's data parallelism over
the `data` axis is unchanged: every replica runs its own pipeline on its
share of the batch and the engine all-reduces each stage's gradients
among the s-th devices of the replicas.
"""

from tfpar import batches
from tfpar.common import clipping
from tfpar.engine import extended as engine_extended
from tfpar.engine import materialize
from tfpar.engine import prepared_models
from tfpar.pipeline import executor
from tfpar.pipeline import placement
from tfpar.pipeline import stages as stages_lib
from tfpar.pipeline import steps as steps_lib


class PipelineParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.PipelineParallelStrategy`.

  Args:
    container_strategy: the public strategy.
    mesh: the `tfpar.Mesh` (data x pipeline x tensor).
    num_microbatches: micro-batches per replica batch.
    schedule: a name from `schedules.SCHEDULES`.
    stages: `"auto"` or the names of the layers starting stages 1..v p-1.
    recompute: recompute each stage's forward in its backward.
    plan: the `tfpar.ShardingPlan` of tensor-parallel stages.
    virtual_stages: stages per device, v (`interleaved`).
    float32_sums: tensor-parallel stages add partial sums in float32.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
  """

  def __init__(self, container_strategy, mesh, num_microbatches, schedule,
               stages, recompute, virtual_stages, plan,
               communication_options=None, float32_sums=False):
    super().__init__(container_strategy, mesh, communication_options)
    self.float32_sums = float32_sums
    self.num_microbatches = num_microbatches
    self.schedule = schedule
    self.virtual_stages = virtual_stages
    self.stages = stages
    self.recompute = recompute
    self.plan = plan
    self._cutting = False

  @property
  def pipeline_size(self):
    return self._mesh.shape["pipeline"]

  @property
  def num_stages(self):
    """Stages the model is cut into: v per device of the pipeline."""
    return self.pipeline_size * self.virtual_stages

  @property
  def tensor_size(self):
    return self._mesh.shape["tensor"]

  # Weights are created spread over a replica's devices (`engine/spread`)
  # and move to their stage's devices when the model is cut.
  spreads_weights = True

  def register_model(self, model):
    if not self._cutting:  # Not the stages' own sub-models.
      super().register_model(model)

  def stage_plan(self, model):
    """Cuts a built model into this strategy's stages (without placing)."""
    self._cutting = True
    try:
      return stages_lib.plan_stages(model, self.num_stages, self.stages)
    finally:
      self._cutting = False

  def _outer_model(self, model):
    """The built model created in scope that holds `model` as a layer (a
    keras-hub task model's backbone) or as its graph (a Sequential's
    Functional one, which Keras creates in scope too), or None."""
    for outer in self.registered_models():
      if outer.built and prepared_models.holds(outer, model):
        return outer
    return None

  def prepare_model(self, model):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
      self.prepare_optimizer(optimizer, model)
    if not model.built or self.is_prepared(model):
      return
    if self._outer_model(model) is not None:
      # Cut as part of the model that calls it (its layers are inlined
      # there, `stages.plan_stages`), not as a pipeline of its own.
      return
    steps_lib.check_model(model)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
      raise ValueError(
          f"The optimizer of model {model.name!r} was built before the model "
          f"was cut into pipeline stages, so its state sits on the wrong "
          f"devices. Create and compile the model in strategy.scope(), and "
          f"load saved weights with model.load_weights() after compile.")
    # Resolved before cutting: the stages' sub-models add nodes to their
    # layers, which hides the Dense pairs the built-in plan looks for.
    layer_layouts = self.tensor_layouts(model)
    elsewhere = self.laid_out_elsewhere(model)  # Checked before any move.
    plan = self.stage_plan(model)
    split = {v.path for layout in layer_layouts or () for v in
             layout.variables if v.axis is not None}
    placement.place_stage_variables(self._container_strategy(), plan,
                                    self._local_groups, self.pipeline_size,
                                    self.tensor_size, skip=split | elsewhere,
                                    devices_of=self.stage_variable_devices)
    if layer_layouts is not None:
      self._shard_stages(model, plan, layer_layouts)
    self.lay_out_elsewhere(model, plan)
    # In no stage.
    materialize.materialize_pending(model, self._container_strategy())
    object.__setattr__(model, "_tfpar_stage_plan", plan)
    pipelined = steps_lib.PipelinedSteps(
        model, lambda: self.runner(plan), self.num_microbatches)
    for name in ("train_step", "test_step", "predict_step"):
      object.__setattr__(model, name, getattr(pipelined, name))

  def laid_out_elsewhere(self, model):
    """Paths of the weights another parallelism lays out (the experts
    under expert x pipeline), which stay where they were created."""
    del model
    return frozenset()

  def lay_out_elsewhere(self, model, plan):
    """Lays out `laid_out_elsewhere`'s weights, once `model` is cut into
    `plan` and its other weights are on their stages' devices."""
    del model, plan

  def prepare_optimizer(self, optimizer, model):
    """Makes `optimizer` clip after the sum over the replicas, as one
    device clips (tensor-parallel stages clip by whole weights instead)."""
    del model
    clipping.clip_after_all_reduce(optimizer)

  def tensor_layouts(self, model):
    """The checked `LayerLayout`s of `model`'s layers split over the
    stages' tensor groups, or None without a tensor axis."""
    del model
    return None

  def _shard_stages(self, model, plan, layer_layouts):
    """Splits each stage's layers over the stage's tensor group (with a
    tensor axis, `tensor_stages.py`)."""
    del model, plan, layer_layouts

  def stage_variable_devices(self, column):
    """The devices a stage's variables go on, from its first column: the
    stage's device in every replica."""
    return tuple(group[column] for group in self._local_groups)

  def runner(self, plan):
    """The `StageRunner` of the replica running now."""
    return executor.StageRunner(
        [stage.model for stage in plan.stages],
        placement.stage_devices(plan, self.current_group(),
                                self.pipeline_size, self.tensor_size),
        self.schedule, self.recompute, self.virtual_stages)

  preparation = "cut it into pipeline stages"

  def is_prepared(self, model):
    if getattr(model, "_tfpar_stage_plan", None) is not None:
      return True
    outer = self._outer_model(model)
    return outer is not None and self.is_prepared(outer)

  def check_batch_size(self, batch_size, what="batch_size"):
    """Raises unless `batch_size` splits into micro-batches per replica."""
    rows = self.num_microbatches * self._mesh.num_replicas
    if batch_size is not None and batch_size % rows:
      raise ValueError(
          f"{what}={batch_size} does not split into num_microbatches="
          f"{self.num_microbatches} equal micro-batches on each of the "
          f"{self._mesh.num_replicas} data replicas: it must be a multiple "
          f"of data x num_microbatches = {rows}.")

  def _experimental_distribute_dataset(self, dataset, options):
    self.check_batch_size(batches.dataset_batch_size(dataset),
                          "the dataset's batch size")
    return super()._experimental_distribute_dataset(dataset, options)
