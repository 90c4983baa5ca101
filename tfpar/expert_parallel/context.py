"""`MoEContext`: what an expert-parallel MoE block's call (`layers.py`)
needs from its strategy: the expert groups and their launchers, where each
expert variable lives, whole expert values for calls outside the replicas,
and the routing drop counters."""

import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import keras_layers
from tfpar._compat import keras_modules
from tfpar._compat import spmd_run
from tfpar.common import whole_weights
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import optimizer as optimizer_lib
from tfpar.expert_parallel import variables as variables_lib


class MoEContext:
  """What an expert-parallel MoE call needs from its strategy.

  Args:
    extended: the `ExpertParallelExtended`.
    groups: the `ExpertGroups`.
    capacity_factor: None (no token is dropped) or a positive number.
    columns: devices of a replica that hold each weight's experts.
    stage_columns: the devices of a replica that run MoE blocks: its
      first (0), under expert x pipeline every stage's device, under
      expert x tensor every device.
    tensor_groups: under expert x tensor, the strategy's
      `TensorGroups`: every device of a replica routes its copy of the
      tokens and runs its own experts (`spmd_exchange.py`), and the column
      of a call or a gradient is the running trace's device.
  """

  def __init__(self, extended, groups, capacity_factor, columns=1,
               stage_columns=(0,), tensor_groups=None):
    self._extended = extended
    self.groups = groups
    self.capacity_factor = capacity_factor
    # Devices of a replica that hold a weight's experts: 1 (its first or
    # its stage's device), or the tensor size under expert x tensor.
    self.columns = columns
    self.stage_columns = tuple(stage_columns)
    self.tensor_groups = tensor_groups
    self.per_device = tensor_groups is not None
    self._launchers = None
    self._expert_variables = {}  # id of tf variable -> ExpertWeight
    self._columns_of = {}  # id of tf variable -> its device column
    self._token_columns = {}  # block path -> the column running it
    self.drop_counters = {}  # block path -> tf.Variable [dropped, routed]

  @property
  def launchers(self):
    if self._launchers is None:
      extended = self._extended
      self._launchers = groups_lib.Launchers(
          self.groups, extended.mesh.replicas, extended.local_replica_ids(),
          distribute.communication_options(extended),
          columns=max(self.columns, max(self.stage_columns) + 1),
          token_columns=self.stage_columns)
    return self._launchers

  def token_column(self, block):
    """The device column of a replica that runs `block` (0: the head;
    under `per_device`, the running trace's device)."""
    if self.per_device:
      return self.current_column()
    return self._token_columns.get(block.path, 0)

  @staticmethod
  def current_column():
    """The running SPMD trace's index in its tensor group (0 outside
    one)."""
    slot = spmd_run.device_replica_id(tf.distribute.get_replica_context())
    return 0 if slot is None else slot.tensor_index

  def replica_id(self):
    """This strategy's replica id in a replica context, else None."""
    strategy = distribute.container_strategy(self._extended)
    context = tf.distribute.get_replica_context()
    if (context is None or not tf.distribute.has_strategy() or
        tf.distribute.get_strategy() is not strategy):
      return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return None if replica is None else int(replica)

  def register(self, weight, block=None, first_column=0):
    """Records a split `weight` of `block`, whose variable lives on the
    replicas' device column `first_column`."""
    if block is not None:
      self._token_columns[block.path] = first_column
    variable = weight.variable
    for key in (id(variable.value), id(keras_layers.storage(variable))):
      self._expert_variables[key] = weight
      self._columns_of[key] = first_column

  def weight_of(self, variable):
    """The `ExpertWeight` of an expert Keras variable."""
    return self._expert_variables[id(keras_layers.storage(variable))]

  def column_of(self, variable):
    """The device column holding an expert tf.Variable (its tensor column,
    its pipeline stage's device, else 0; under `per_device`, the running
    trace's device, whose component of the variable it is)."""
    if self.per_device:
      return self.current_column()
    return self._columns_of.get(id(variable), 0)

  def expert_weights(self):
    """Every `ExpertWeight` split so far."""
    return list(self._expert_variables.values())

  def saved_expert_weights(self, model):
    """`model`'s expert weights and its optimizer's expert slots, as whole
    `ExpertWeight` views, in the order saving reads them."""
    held = whole_weights.held(model)  # `weights` lists them whole.
    weights = [w for w in self.expert_weights()
               if any(w.variable is v for v in held)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
      weights += [e for e in optimizer_lib.whole_entries(optimizer, self)
                  if isinstance(e, variables_lib.ExpertWeight)]
    return weights

  def is_expert_variable(self, variable):
    return id(variable) in self._expert_variables

  def whole_value(self, variable):
    """The whole [E, ...] tensor of an expert variable, for calls outside
    the replicas (every rank must be on this worker, except while Keras
    traces shapes only)."""
    # Not `variable.value`: inside a layer under a mixed policy that is a
    # cast copy.
    weight = self._expert_variables[id(keras_layers.storage(variable))]
    return self.whole_of(weight)

  def whole_of(self, weight):
    """The whole [E, ...] tensor of an `ExpertWeight` (see `whole_value`)."""
    by_rank = weight.components_by_rank()
    # Slots: expert ranks, or under SPMD expert x tensor rank x column.
    missing = [r for r in range(weight.expert) if r not in by_rank]
    if missing and keras_modules.symbolic_scope.in_symbolic_scope():
      # Keras building the model symbolically: only shapes flow.
      piece = next(iter(by_rank.values()))
      return tf.zeros(list(weight.shape), piece.dtype)
    if missing:
      raise ValueError(
          f"Calling the model outside the strategy's replicas needs the "
          f"whole expert weight {weight.path!r}, but the experts of rank(s) "
          f"{missing} live on other workers (the expert groups span "
          f"workers). Use fit / evaluate / predict, or strategy.run.")
    return weight.whole_tensor()

  def count_drops(self, block, kept):
    if self.current_column():  # Per device: its group's first counts.
      return
    counter = self.drop_counters[block.path]
    dropped = tf.reduce_sum(tf.cast(tf.logical_not(kept), tf.float32))
    routed = tf.cast(tf.size(kept), tf.float32)
    counter.assign_add(tf.stack([dropped, routed]))
