"""`TensorParallelExtended`: tensor parallelism, one trace of the step per
device of every tensor group (SPMD).

`num_replicas_in_sync` stays the `data` size (a replica is a tensor
group: Keras's loss scaling, metrics and predict stay correct). How a
replica runs:

* a model's weights are created spread (`engine/spread.py`), laid out
  when it is sharded; every variable is then mirrored over all `data x
  tensor` devices (replica major): a split weight's component on the k-th
  device of every replica holds shard k (`spmd/weights.py`), a replicated
  weight is the same everywhere;
* `_call_for_each_replica` hands each replica's inputs to every device of
  its group and traces the replica function once per device (replica
  threads whose replica id is the data replica, `_compat/spmd_run.py`);
  the traces communicate by collectives among the group
  (`engine/per_device/collectives.py`);
* gradients (one per device) are all-reduced over the data replicas within
  each tensor column (`engine/per_device/reductions.py`): shard k's over the k-th
  devices, a replicated weight's copies alike on every column (they are
  equal by construction);
* values leaving a replica (losses, metrics, predictions) are taken from
  the first device of each group, and cross-replica reads of metric
  variables count each data replica once.

keras-hub's `CausalLM.generate` runs its model's `call_with_cache` once per
device, the key/value cache split by heads (`spmd/generation.py`).

Models register themselves when created in the strategy's scope (Keras's
TensorFlow trainer records the current strategy then); each is sharded once
it is built, before it first runs, is distributed data, or its optimizer
builds.
"""

from tfpar._compat import keras_layers
from tfpar.common import whole_weights
from tfpar.engine import materialize
from tfpar.engine import spread
from tfpar.engine import variable_placement
from tfpar.engine.per_device import checks as per_device_checks
from tfpar.engine.per_device import collectives
from tfpar.engine.per_device import extended as per_device_extended
from tfpar.tensor_parallel import plan as plan_lib
from tfpar.tensor_parallel import structure
from tfpar.tensor_parallel.spmd import adapters
from tfpar.tensor_parallel.spmd import checks
from tfpar.tensor_parallel.spmd import dropout as dropout_lib
from tfpar.tensor_parallel.spmd import generation
from tfpar.tensor_parallel.spmd import layers as layers_lib
from tfpar.tensor_parallel.spmd import memo as memo_lib
from tfpar.tensor_parallel.spmd import optimizer as optimizer_lib
from tfpar.tensor_parallel.spmd import sequence as sequence_lib
from tfpar.tensor_parallel.spmd import terms
from tfpar.tensor_parallel.spmd import weights as weights_lib


class TensorParallelExtended(per_device_extended.PerDeviceExtended):
  """The logic of `tfpar.TensorParallelStrategy`.

  Args:
    container_strategy: the public strategy.
    mesh: the `tfpar.Mesh` (data x tensor; each tensor group on one
      worker).
    plan: a `tfpar.ShardingPlan`.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
    sequence_parallel: run position-wise regions on sequence slices
      (`spmd/sequence.py`).
    float32_sums: add partial sums in float32 under a mixed policy.
    zero: None or a `tfpar.ZeRO` applied to every model once sharded.
  """

  # Weights are created spread over the tensor group (`engine/spread.py`),
  # then laid out when the model is sharded: replicated ones whole on every
  # device (where every trace uses them; `describe` lists them there),
  # split ones as their shards.
  spreads_weights = True

  def __init__(self, container_strategy, mesh, plan,
               communication_options=None, sequence_parallel=False,
               float32_sums=False, zero=None):
    per_device_checks.check_strategy(mesh)
    super().__init__(container_strategy, mesh, communication_options)
    self._plan = plan
    self._sequence_parallel = sequence_parallel
    self.float32_sums = float32_sums
    self._zero = zero
    self._groups = collectives.TensorGroups(
        self._local_groups, self._collective_keys,
        self._communication_options,
        [tuple(group) for group in mesh.replicas])
    self._memo = memo_lib.Memo(self._groups, sequence_parallel,
                                 float32_sums)
    self._first_replica = mesh.replicas.index(self._local_groups[0])

  @property
  def plan(self):
    return self._plan

  @property
  def tensor_size(self):
    return self._mesh.shape["tensor"]

  @property
  def zero(self):
    """The `tfpar.ZeRO` applied to every model once sharded, or None."""
    return self._zero

  @property
  def tensor_groups(self):
    """The `collectives.TensorGroups` (devices, launchers)."""
    return self._groups

  @property
  def partial_weights(self):
    """The weights whose gradient is partial on each device."""
    return self._memo.partial_weights

  # Variables: on every data x tensor device.

  def _create_variable(self, next_creator, **kwargs):
    # Not in a trace (a model built while a step runs, refused after it):
    # spread slices have a component per replica there, not per device.
    spreading = (spread.should_spread(kwargs) and
                 collectives.current_slot() is None)
    if not self.placed_by_caller(kwargs) and not spreading:
      kwargs["colocate_with"] = variable_placement.DeviceSet(
          self._groups.devices)
    return super()._create_variable(next_creator, **kwargs)

  # Model registry and sharding.

  preparation = "shard it, so its weights would stay replicated"

  def is_prepared(self, model):
    return getattr(model, "_tfpar_layouts", None) is not None

  def prepares_outermost_first(self):
    # Sequence parallelism runs on the graph of the model it splits, a
    # keras-hub backbone's, not on a task model holding it as one layer.
    return not self._sequence_parallel

  def prepare_model(self, model):
    if not self.is_prepared(model) and model.built:
      self.shard_model(model)
    elif self.is_prepared(model) and (
        getattr(model, "optimizer", None) is not None):
      self._adopt(model.optimizer, model)
    optimizer = getattr(model, "optimizer", None)
    if (self._zero is not None and self.is_prepared(model) and
        optimizer is not None and not optimizer.built and
        getattr(optimizer, "_tfpar_zero", None) is None):
      self._zero.prepare_fit(model)  # As the callback does at `fit`.

  def adopt_loop_optimizer(self, optimizer, model, variables):
    """A custom training loop's optimizer works on the model's shards as a
    compiled one does (`_adopt`), and is sharded under `zero=`."""
    del variables
    if model is None:
      return
    self._adopt(optimizer, model)
    if self._zero is not None:
      self._zero.prepare_loop_optimizer(model, optimizer,
                                        self._container_strategy())

  def laid_out_elsewhere(self, model):
    """Paths of `model`'s weights another parallelism lays out (left
    spread by `shard_model`); none here."""
    del model
    return frozenset()

  def shard_model(self, model):
    """Splits `model`'s weights per the plan into SPMD variables and makes
    its split layers compute SPMD."""
    already = tuple(
        layer._tfpar_layer_layout  # pylint: disable=protected-access
        for layer in keras_layers.flatten_layers(
            model, include_self=False)
        if getattr(layer, "_tfpar_layer_layout", None) is not None)
    optimizer = getattr(model, "optimizer", None)
    # Weights another parallelism lays out (expert x tensor's experts) stay
    # spread until it does.
    elsewhere = self.laid_out_elsewhere(model)
    if not already:
      checks.check_model(model, self._sequence_parallel)
      with structure.shared_trace(model):  # One trace for both.
        already = plan_lib.as_plan(self._plan).resolve(
            model, self.tensor_size, elsewhere)
        checks.check_layouts(already, self._sequence_parallel, model)
        paired = layers_lib.paired_layers(model, already)
      strategy = self._container_strategy()
      terms.check(already, paired, self._sequence_parallel)
      # Replicated weights first: until then every device holds 1/tensor
      # of them, less than its final share (all of them).
      split = {v.path for layout in already for v in layout.variables
               if v.axis is not None}
      materialize.materialize_pending(model, strategy, skip=split | elsewhere)
      for layout in already:
        with spread.creating_in_place():
          weights_lib.split_layer(layout, self.tensor_size, strategy)
        layers_lib.install(layout, self._memo, paired)
        object.__setattr__(layout.layer, "_tfpar_layer_layout", layout)
    # Weights of layers outside the layouts (a head added around a model
    # sharded before) stay whole on every device.
    materialize.materialize_pending(model, self._container_strategy(),
                                    skip=elsewhere)
    if self._sequence_parallel:
      sequence_lib.install(model, self._memo.slices)
    dropout_lib.install(model, already, self._memo)
    object.__setattr__(model, "_tfpar_layouts", already)
    whole_weights.install(model)
    adapters.install(model, self._container_strategy(), self.tensor_size)
    if optimizer is not None and optimizer.built and not getattr(
        optimizer, "_tfpar_adopted", False):
      # Built for the unsharded weights (keras.models.load_model): move
      # its state to a twin built for the shards.
      with self._container_strategy().scope():
        optimizer_lib.rebuild_for_shards(model)
      optimizer = model.optimizer
    if optimizer is not None:
      self._adopt(optimizer, model)

  def _adopt(self, optimizer, model):
    """Makes `optimizer` work on `model`'s shards (whole-slot checkpoints,
    clipping by whole weights, sums over the tensor group)."""
    optimizer_lib.adopt(optimizer, model, self._groups,
                        self._memo.partial_weights)

  def generate_function(self, model):
    """keras-hub's `generate` with `call_with_cache` run per device, the
    key/value cache split by heads (`spmd/generation.py`)."""
    return generation.generate_function(self, model, self._sequence_parallel)

  def _clear_memos(self):
    self._memo.clear()
