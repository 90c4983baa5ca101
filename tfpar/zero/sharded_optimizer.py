"""Turning a Keras optimizer into a ZeRO optimizer (stages 1, 2 and 3).

Each trainable weight (flattened, padded to a multiple of N replicas) is
owned slice by slice: replica r keeps the optimizer state of slice r only,
in slice variables of 1/N of the size. A step reduce-scatters the gradients
(each replica receives the sum over replicas of its slice), clips them as
one device would, updates each replica's slice with the optimizer's own
`update_step` (so every Keras optimizer whose state is elementwise works
unchanged) and all-gathers the updated slices into the weights.

* Stage 1 accumulates gradients (`gradient_accumulation_steps`) in full-size
  local buffers and communicates once per update.
* Stage 2 also slices the accumulation buffers: every micro-step
  reduce-scatters, and only the replica's slice is kept.
* Stage 3 also slices the weights (see `sharded_weights`): the gradient
  tape returns reduced slices already, and nothing is gathered after the
  update.
"""

import dataclasses

import keras
import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import keras_optimizers
from tfpar.common import strategy_hooks
from tfpar.common.clipping import clips
from tfpar.zero import clipping
from tfpar.zero import collectives
from tfpar.zero import shardable
from tfpar.zero import slices
from tfpar.zero import sparse_gradients

@dataclasses.dataclass
class Entry:
  """A trainable weight and the slice the update step works on.

  Attributes:
    weight: the model's Keras variable.
    slice: a slice variable: a copy of the weight's slice (stages 1-2) or
      the weight's only storage (stage 3).
    size: elements per slice.
    devices: the device of each local replica's slice.
    column: under tensor parallelism, the index within each replica of
      the device holding the weight (its shard), else None.
  """
  weight: object
  slice: object
  size: int
  devices: list
  column: object = None


@dataclasses.dataclass
class ZeroState:
  """What `shard` installs on an optimizer (`optimizer._tfpar_zero`)."""
  stage: int
  offload: object
  strategy: object
  bucket_bytes: int = collectives.DEFAULT_BUCKET_BYTES
  entries: dict = dataclasses.field(default_factory=dict)  # id(weight)
  slot_references: dict = dataclasses.field(default_factory=dict)  # id(slot)
  unsliced_references: dict = dataclasses.field(default_factory=dict)

  @property
  def replicas(self):
    return self.strategy.num_replicas_in_sync

  @property
  def replica_ids(self):
    return slices.local_replica_ids(self.strategy)

  def weight_devices(self, weight):
    """The device of each local replica's copy (or shard) of a weight."""
    return [c.device for c in slices.components(weight)]

  def state_devices(self, weight):
    """Where a weight's optimizer state lives: beside each replica's copy
    of the weight, or with CPU offload on the host CPU of its worker."""
    devices = self.weight_devices(weight)
    if self.offload != "cpu":
      return devices
    return [tf.DeviceSpec.from_string(d).replace(
        device_type="CPU", device_index=0).to_string() for d in devices]

  def column(self, weight):
    column_of = getattr(self.strategy.extended, "column_of", None)
    return column_of(weight.value) if column_of else None

  def new_slice(self, reference, name, values, devices=None,
                trainable=False):
    return slices.new_slice_variable(
        self.strategy, f"{reference.path.replace('/', '_')}_{name}",
        reference.dtype, devices or self.state_devices(reference), values,
        trainable)

  def add_entry(self, weight, piece):
    self.entries[id(weight)] = Entry(
        weight, piece, piece.shape[0], self.state_devices(weight),
        self.column(weight))

  @property
  def columns(self):
    """Components of a variable per replica: 1, or the tensor size under
    SPMD tensor parallelism (every device of a replica holds one)."""
    return getattr(self.strategy.extended, "zero_traces_per_replica", 1)

  def component_replicas(self):
    """The replica owning each of a variable's local components."""
    return [r for r in self.replica_ids for _ in range(self.columns)]

  def weight_slices(self, weight):
    """Each local component's slice (its replica's) of a weight's value."""
    size = slices.slice_size(weight.shape, self.replicas)
    owners = self.component_replicas()
    parts = slices.components(weight)
    if len(parts) != len(owners):  # Not one per replica: the value.
      parts = [weight.value] * len(owners)
    return [slices.flat_slice(p, r, size, self.replicas)
            for p, r in zip(parts, owners)]


def shard(optimizer, state):
  """Makes an unbuilt Keras optimizer keep 1/N of its state per replica.

  Args:
    optimizer: a Keras optimizer, not built yet
      (`shardable.check_shardable`).
    state: its `ZeroState`; under stage 3 its entries already hold the
      model's sliced weights.
  """
  object.__setattr__(optimizer, "_tfpar_zero", state)
  original_from_reference = optimizer.add_variable_from_reference
  original_build = optimizer.build
  unsharded = ("gradient_accumulator",) if state.stage == 1 else ()

  def add_variable_from_reference(reference_variable, name=None,
                                  initializer="zeros"):
    if name in unsharded:
      whole = original_from_reference(reference_variable, name, initializer)
      state.unsliced_references[id(whole)] = reference_variable
      return whole
    size = slices.slice_size(reference_variable.shape, state.replicas)
    value = keras.initializers.get(initializer)((size,),
                                                reference_variable.dtype)
    slot = state.new_slice(reference_variable, name or "var",
                           [value] * len(state.component_replicas()))
    keras_optimizers.track_variable(optimizer, slot)
    state.slot_references[id(slot)] = reference_variable
    return slot

  def build(variables):
    if optimizer.built:
      return
    with state.strategy.scope():
      original_build(variables)
      for variable in variables:
        if id(variable) in state.entries:
          continue  # Stage 3: the weight is its own slice.
        proxy = state.new_slice(variable, "zero_slice",
                                state.weight_slices(variable))
        keras_optimizers.track_variable(optimizer, proxy)
        state.add_entry(variable, proxy)
      for entry in state.entries.values():
        keras_optimizers.share_variable_index(optimizer, entry.slice,
                                              entry.weight)

  def apply_gradients(grads, trainable_variables):
    _apply_sharded(optimizer, state, list(grads), list(trainable_variables))

  def update_step(grads, trainable_variables):
    _update(optimizer, state,
            [state.entries[id(v)] for v in trainable_variables], grads)

  keras_optimizers.with_update_step(optimizer, update_step)
  object.__setattr__(optimizer, "add_variable_from_reference",
                     add_variable_from_reference)
  object.__setattr__(optimizer, "build", build)
  keras_optimizers.replace_apply_gradients(optimizer, apply_gradients)


def _apply_sharded(optimizer, state, grads, variables):
  if tf.executing_eagerly():
    shardable.refuse_eager_replicas(
        state.stage, f"applies the gradients of optimizer {optimizer.name!r}")
  entries = [state.entries[id(v)] for v in variables]
  # Per-device (SPMD) strategies: partial ones summed over the group.
  grads = strategy_hooks.of(state.strategy).zero_partial_gradients(
      grads, variables)
  if state.stage == 3:  # The tape's gradients are reduced slices.
    reduce = lambda gs: [tf.convert_to_tensor(g) if clips(optimizer) else g
                         for g in gs]
  else:
    reduce = lambda gs: _reduce_scattered(state, gs, entries)
  steps = optimizer.gradient_accumulation_steps
  # Stage 3's sparse slices keep every row's entries: noted as they come.
  clipping.note_sparse(grads if not steps else (), variables)
  if not steps:
    if state.stage != 3 and not clips(optimizer):
      # Sparse gradients as MirroredStrategy applies them.
      reduce = lambda gs: _reduce_scattered(state, gs, entries, sparse=True)
    keras_optimizers.update_step(optimizer, reduce(grads), variables,
                                 optimizer.learning_rate)
    return
  accumulators = [slices.local_component(
      keras_optimizers.accumulated_gradients(optimizer)[
          keras_optimizers.variable_index(optimizer, v)])
                  for v in variables]
  if state.stage != 1:
    grads = reduce(grads)
    reduce = lambda gs: gs

  def update():
    totals = reduce([(g + a) / steps for g, a in zip(grads, accumulators)])
    keras_optimizers.update_step(optimizer, totals, variables,
                                 optimizer.learning_rate)
    for accumulator in accumulators:
      accumulator.assign(tf.zeros_like(accumulator))

  def accumulate():
    for grad, accumulator in zip(grads, accumulators):
      accumulator.assign_add(grad)

  is_update_step = (
      keras_optimizers.iterations_variable(optimizer) + 1) % steps == 0
  tf.cond(is_update_step, update, accumulate)


def _reduce_scattered(state, grads, entries, sparse=False):
  """Each replica's slice of the summed gradients, dense ones bucketed; with
  `sparse`, `IndexedSlices` stay sparse (see `sparse_gradients`)."""
  phase = collectives.OPTIMIZER
  reduced = [None] * len(grads)
  dense = []
  for index, (grad, entry) in enumerate(zip(grads, entries)):
    if sparse and isinstance(grad, tf.IndexedSlices):
      reduced[index] = sparse_gradients.sliced_sparse_gradient(
          grad, entry.weight.shape, entry.weight.path, entry.column,
          entry.size)
    else:
      dense.append(index)
  flats = collectives.reduce_scatter_many(
      [slices.padded_flat(grads[i], entries[i].size * state.replicas)
       for i in dense], phase, [entries[i].weight.path for i in dense],
      [entries[i].column for i in dense], state.bucket_bytes)
  for index, flat in zip(dense, flats):
    reduced[index] = flat
  return reduced


def _update(optimizer, state, entries, grad_slices):
  """Clips, decays and updates each replica's slices; stages 1-2 then
  all-gather the slices into the weights."""
  context = tf.distribute.get_replica_context()
  replica = context.replica_id_in_sync_group
  grad_slices = clipping.clip(optimizer, state, entries, grad_slices)
  learning_rate = optimizer.learning_rate
  for entry, grad in zip(entries, grad_slices):
    weight, piece = entry.weight, entry.slice
    with tf.device(entry.devices[distribute.local_replica_index(context)]):
      if state.stage != 3:
        piece.assign(slices.flat_slice(weight.value, replica, entry.size,
                                       state.replicas))
      if optimizer.weight_decay and keras_optimizers.uses_weight_decay(
          optimizer, weight):
        rate = tf.cast(learning_rate, piece.dtype)
        decay = tf.cast(optimizer.weight_decay, piece.dtype)
        piece.assign(piece - piece * decay * rate)
      optimizer.update_step(grad, piece, learning_rate)
  if state.stage == 3:
    return
  wholes = collectives.all_gather_many(
      [tf.convert_to_tensor(e.slice.value) for e in entries],
      collectives.OPTIMIZER, [e.weight.path for e in entries],
      [e.column for e in entries], state.bucket_bytes)
  for entry, whole in zip(entries, wholes):
    weight = entry.weight
    slices.local_component(weight).assign(tf.reshape(
        whole[:weight.shape.num_elements()], weight.shape))


def logical_entries(optimizer):
  """(optimizer variable, weight it slices or None) in the order an
  unsharded optimizer has its variables; weight slices are left out."""
  state = optimizer._tfpar_zero  # pylint: disable=protected-access
  pieces = {id(e.slice) for e in state.entries.values()}
  return [(v, state.slot_references.get(id(v))) for v in optimizer.variables
          if id(v) not in pieces]
