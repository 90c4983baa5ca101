"""`TensorParallelExtended`: shards models built in its scope.

Each replica spans the devices of one `tensor` group. Shard k of a weight
is a mirrored variable on the k-th device of every replica, so the data
axis keeps it in sync exactly as it does a replicated weight, and Keras's
optimizer creates its slots next to it (`colocate_vars_with`).

Models register themselves when created in the strategy's scope (Keras's
TensorFlow trainer records the current strategy then); each is sharded once
it is built, before it first runs, is distributed data, or its optimizer
builds: when the scope is entered again (Keras does so before its symbolic
build), when a dataset is distributed and when a step runs.
"""



from tfpar._compat import distribute
from tfpar._compat import keras_layers
from tfpar.common import whole_weights
from tfpar.engine import extended as engine_extended
from tfpar.engine import spread
from tfpar.tensor_parallel import layers as layers_lib
from tfpar.tensor_parallel import optimizer as optimizer_lib
from tfpar.tensor_parallel import plan as plan_lib
from tfpar.tensor_parallel import sequence as sequence_lib
from tfpar.tensor_parallel import variables as variables_lib


class TensorParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.TensorParallelStrategy`.

  Args:
    container_strategy: the public strategy.
    mesh: the `tfpar.Mesh` (data x tensor).
    plan: a `tfpar.ShardingPlan`.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    sequence_parallel: split position-wise regions along the sequence.
    float32_sums: add partial sums in float32 under a mixed policy.
  """

  def __init__(self, container_strategy, mesh, plan,
               communication_options=None, sequence_parallel=False,
               float32_sums=False):
    super().__init__(container_strategy, mesh, communication_options)
    self._plan = plan
    self._sequence_parallel = sequence_parallel
    self.float32_sums = float32_sums

  @property
  def plan(self):
    return self._plan

  @property
  def tensor_size(self):
    return self._mesh.shape["tensor"]

  # Weights are created spread over the tensor group (1/tensor of each on
  # every device of a replica) and laid out one at a time once the plan is
  # resolved on the built model.
  spreads_weights = True

  # Model registry and sharding.

  preparation = "shard it, so its weights would stay replicated"

  def is_prepared(self, model):
    return getattr(model, "_tfpar_layouts", None) is not None

  def prepare_model(self, model):
    if not self.is_prepared(model) and model.built:
      self.shard_model(model)
    elif self.is_prepared(model) and (
        getattr(model, "optimizer", None) is not None):
      self._adopt(model.optimizer, model)

  def _adopt(self, optimizer, model):
    """Makes `optimizer` work on `model`'s shards (its checkpoints and
    clipping in whole weights)."""
    optimizer_lib.adopt(optimizer, model)

  def laid_out_elsewhere(self, model):
    """Paths of `model`'s weights another parallelism lays out (left
    spread by `shard_model`); none here."""
    del model
    return frozenset()

  def shard_model(self, model):
    """Applies the plan to a built model: splits its variables and makes
    its sharded layers compute tensor-parallel."""
    optimizer = getattr(model, "optimizer", None)
    already = tuple(
        layer._tfpar_layer_layout  # pylint: disable=protected-access
        for layer in keras_layers.flatten_layers(model, include_self=False)
        if getattr(layer, "_tfpar_layer_layout", None) is not None)
    if already:  # Its layers belong to a model sharded before (Sequential,
      # or a keras-hub backbone inside a task model): weights of its own
      # layers outside that model (a Dense head) stay whole, as before
      # weights were created spread.
      for variable in spread.pending_weights(model):
        spread.materialize(variable, self._container_strategy())
      object.__setattr__(model, "_tfpar_layouts", already)
      whole_weights.install(model)
      return
    elsewhere = self.laid_out_elsewhere(model)
    layer_layouts = plan_lib.as_plan(self._plan).resolve(
        model, self.tensor_size, elsewhere)
    # Replicated weights first: until then every device holds 1/tensor of
    # them, more than its final share (none, off the head).
    split = {v.path for layout in layer_layouts for v in layout.variables
             if v.axis is not None}
    for variable in spread.pending_weights(model):
      if variable.path not in split and variable.path not in elsewhere:
        spread.materialize(variable, self._container_strategy())
    shard_layers(self, layer_layouts, self.tensor_size,
                 sequence_parallel=self._sequence_parallel)
    for variable in spread.pending_weights(model):  # Only `elsewhere` left.
      if variable.path not in elsewhere:
        spread.materialize(variable, self._container_strategy())
    if self._sequence_parallel:
      sequence_lib.install(model, self.current_group)
    object.__setattr__(model, "_tfpar_layouts", layer_layouts)
    whole_weights.install(model)
    if optimizer is not None and optimizer.built:
      # Built for the unsharded weights (e.g. by keras.models.load_model):
      # move its state to a twin built for the shards.
      with self._container_strategy().scope():
        optimizer_lib.rebuild_for_shards(model)
    elif optimizer is not None:
      self._adopt(optimizer, model)


def shard_layers(extended, layer_layouts, tensor_size, first_column=0,
                 sequence_parallel=False):
  """Splits layers over `tensor_size` consecutive devices of every replica.

  Shard k of each split variable goes on device `first_column + k` of
  every replica, and each layer computes on those devices (the first one
  is the group's head). Tensor parallelism uses the whole replica
  (`first_column` 0); a tensor-parallel pipeline stage s uses its own
  devices (`first_column` s x tensor).

  Args:
    extended: the strategy's `MeshExtended`.
    layer_layouts: the `LayerLayout`s to apply (from `ShardingPlan.resolve`).
    tensor_size: devices per tensor group.
    first_column: the index within a replica of the group's first device.
    sequence_parallel: split position-wise regions along the sequence.

  Partial sums are added in float32 when `extended.float32_sums` is set
  (the strategies' default `communication_dtype="float32"`).
  """
  columns = slice(first_column, first_column + tensor_size)

  def group():
    return extended.current_group()[columns]

  def shard_scope(index):
    return extended.variables_on_column(first_column + index)

  with distribute.container_strategy(extended).scope():
    for layout in layer_layouts:
      variables_lib.shard_layer(layout, tensor_size, shard_scope)
      layers_lib.install(layout, group, sequence_parallel,
                         getattr(extended, "float32_sums", False))
      object.__setattr__(layout.layer, "_tfpar_layer_layout", layout)
