"""`PipelineParallelExtended`: cuts models into stages and pipelines them.

Each replica spans the mesh's `pipeline` devices; stage s of a model lives
on device s of every replica (its variables and, through Keras's
`colocate_vars_with`, its optimizer slots). Keras's data parallelism over
the `data` axis is unchanged: every replica runs its own pipeline on its
share of the batch and the engine all-reduces each stage's gradients
among the s-th devices of the replicas.
"""


from tensorflow.python.data.ops import dataset_ops

from tfpar import keras_hooks
from tfpar.engine import extended as engine_extended
from tfpar.pipeline import executor
from tfpar.pipeline import placement
from tfpar.pipeline import stages as stages_lib
from tfpar.pipeline import steps as steps_lib


class PipelineParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.PipelineParallelStrategy`.

  Args:
    container_strategy: the public strategy.
    mesh: the `tfpar.Mesh` (data x pipeline).
    num_microbatches: micro-batches per replica batch.
    schedule: `"gpipe"` or `"1f1b"`.
    stages: `"auto"` or the names of the layers starting stages 1..p-1.
    recompute: recompute each stage's forward in its backward.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
  """

  def __init__(self, container_strategy, mesh, num_microbatches, schedule,
               stages, recompute, communication_options=None):
    super().__init__(container_strategy, mesh, communication_options)
    self.num_microbatches = num_microbatches
    self.schedule = schedule
    self.stages = stages
    self.recompute = recompute
    self._cutting = False
    keras_hooks.install_batch_size_checks()

  @property
  def num_stages(self):
    return self._mesh.shape["pipeline"]

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
    keras_hooks.install_batch_size_checks()

  def prepare_model(self, model):
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
    plan = self.stage_plan(model)
    placement.place_stage_variables(self._container_strategy(), plan,
                                    self._local_groups)
    object.__setattr__(model, "_tfpar_stage_plan", plan)
    pipelined = steps_lib.PipelinedSteps(
        model, lambda: self.runner(plan), self.num_microbatches)
    for name in ("train_step", "test_step", "predict_step"):
      object.__setattr__(model, name, getattr(pipelined, name))

  def runner(self, plan):
    """The `StageRunner` of the replica running now."""
    return executor.StageRunner(
        [stage.model for stage in plan.stages],
        placement.stage_devices(plan, self.current_group()), self.schedule,
        self.recompute)

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
    self.check_batch_size(_batch_size_of(dataset),
                          "the dataset's batch size")
    return super()._experimental_distribute_dataset(dataset, options)


def _batch_size_of(dataset):
  """The batch size a tf.data pipeline was batched with, if it says."""
  while dataset is not None:
    batch_size = getattr(dataset, "_batch_size", None)
    if batch_size is not None:
      try:
        return int(batch_size.numpy())
      except (AttributeError, TypeError, ValueError):
        return None
    inputs = getattr(dataset, "_input_dataset", None)
    if inputs is None or not isinstance(inputs, dataset_ops.DatasetV2):
      return None
    dataset = inputs
  return None


