"""`PipelineParallelExtended`: cuts models into stages and pipelines them.

Each replica spans the mesh's `pipeline x tensor` devices; stage s of a
model lives on devices s x tensor .. (s + 1) x tensor - 1 of every replica
(its variables and, through Keras's `colocate_vars_with`, its optimizer
slots). With a `tensor` axis each stage's layers are split over its
devices by the sharding plan, as tensor parallelism splits a whole model
(3D parallelism); the stage's first device is its head. Keras's data parallelism over
the `data` axis is unchanged: every replica runs its own pipeline on its
share of the batch and the engine all-reduces each stage's gradients
among the s-th devices of the replicas.
"""

import numpy as np

from tfpar import batches
from tfpar.common import clipping
from tfpar.common import whole_weights
from tfpar.engine import extended as engine_extended
from tfpar.engine import spread
from tfpar.pipeline import executor
from tfpar.pipeline import placement
from tfpar.pipeline import stages as stages_lib
from tfpar.pipeline import steps as steps_lib
from tfpar.tensor_parallel import extended as tensor_parallel_extended
from tfpar.tensor_parallel import optimizer as tensor_parallel_optimizer


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

  def prepare_model(self, model):
    optimizer = getattr(model, "optimizer", None)
    # Without a tensor axis the optimizer clips after the sum over replicas
    # (with one, `_adopt` installs that clipping by whole weights).
    if self.tensor_size == 1 and optimizer is not None:
      clipping.clip_after_all_reduce(optimizer)
    if self.is_prepared(model) and self.tensor_size > 1 and (
        optimizer is not None):
      self._adopt(optimizer, model)
    if not model.built or self.is_prepared(model):
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
    layer_layouts = (self.plan.resolve(model, self.tensor_size)
                     if self.tensor_size > 1 else None)
    if layer_layouts is not None:
      self._check_layouts(model, layer_layouts)
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
    for variable in spread.pending_weights(model):  # In no stage.
      spread.materialize(variable, self._container_strategy())
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

  def _shard_stages(self, model, plan, layer_layouts):
    """Splits each stage's layers over the stage's tensor group."""
    stage_of = plan.stage_of_layers()
    by_stage = {stage.index: [l for l in layer_layouts
                              if stage_of.get(id(l.layer)) == stage.index]
                for stage in plan.stages}
    shard = self._stage_layout_sharder(stage_of)
    # Interleaved over the stages: split weights created spread over every
    # device leave each about as fast as its shards arrive (engine/spread).
    layout_bytes = lambda l: sum(np.prod(v.shape) for v in l.variables)
    for index, layout in placement.interleaved(by_stage, layout_bytes):
      shard(index, layout)
    self._sharded(model, plan, layer_layouts, by_stage)

  def _stage_layout_sharder(self, stage_of):
    """`shard(stage index, layout)`: splits one layer over its stage's
    tensor group (`stage_of`: {id(layer): its stage})."""
    del stage_of

    def shard(index, layout):
      tensor_parallel_extended.shard_layers(
          self, [layout], self.tensor_size,
          first_column=placement.stage_column(index, self.pipeline_size,
                                              self.tensor_size))
    return shard

  def _sharded(self, model, plan, layer_layouts, by_stage):
    """Records `model`'s layouts once its stages are split (`by_stage`:
    {stage index: its layouts}), and makes its weight lists and optimizer
    speak whole weights."""
    del by_stage
    object.__setattr__(model, "_tfpar_layouts", layer_layouts)
    whole_weights.install(model)
    # The stage models are Models of their own over the same layers: their
    # `trainable_weights` (read for regularization losses) must list the
    # shards too, not their layers' whole weights.
    for stage in plan.stages:
      whole_weights.install(stage.model)
    if getattr(model, "optimizer", None) is not None:
      self._adopt(model.optimizer, model)

  def _check_layouts(self, model, layer_layouts):
    """Checks the resolved tensor plan before the model is cut (and reads
    what cutting would hide); nothing more to check here."""
    del model, layer_layouts

  def stage_variable_devices(self, column):
    """The devices a stage's variables go on, from its first column: the
    stage's head in every replica."""
    return tuple(group[column] for group in self._local_groups)

  def _adopt(self, optimizer, model):
    """Makes `optimizer` work on the tensor-parallel stages' shards."""
    tensor_parallel_optimizer.adopt(optimizer, model)

  def runner(self, plan):
    """The `StageRunner` of the replica running now."""
    return executor.StageRunner(
        [stage.model for stage in plan.stages],
        placement.stage_devices(plan, self.current_group(),
                                self.pipeline_size, self.tensor_size),
        self.schedule, self.recompute, self.virtual_stages)

  preparation = "cut it into pipeline stages"

  def is_prepared(self, model):
    return getattr(model, "_tfpar_stage_plan", None) is not None

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
