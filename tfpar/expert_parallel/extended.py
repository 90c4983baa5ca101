"""`ExpertParallelExtended`: splits the experts of MoE layers built in its
scope over expert groups of data replicas (see `groups.py`)."""

import numpy as np
import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import keras_hub_names
from tfpar._compat import keras_layers
from tfpar._compat import keras_modules
from tfpar.common import whole_weights
from tfpar.engine import extended as engine_extended
from tfpar.expert_parallel import families
from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import layers
from tfpar.expert_parallel import optimizer as optimizer_lib
from tfpar.expert_parallel import variables as variables_lib
from tfpar.expert_parallel import whole_experts
from tfpar.memory import components


class MoEContext:
  """What an expert-parallel MoE call needs from its strategy.

  Args:
    extended: the `ExpertParallelExtended`.
    groups: the `ExpertGroups`.
    capacity_factor: None (no token is dropped) or a positive number.
    columns: devices of a replica that hold each weight's experts.
    on_column: under expert x tensor, runs experts on a tensor column.
    stage_columns: the devices of a replica that run MoE blocks: its head
      (0), or under expert x pipeline every stage's device.
  """

  def __init__(self, extended, groups, capacity_factor, columns=1,
               on_column=None, stage_columns=(0,)):
    self._extended = extended
    self.groups = groups
    self.capacity_factor = capacity_factor
    # Devices of a replica that hold a weight's experts: 1 (its head or
    # its stage's device), or the tensor size under expert x tensor, where
    # `on_column(k, fn, *inputs)` runs `fn` forward and backward on the
    # running replica's k-th device.
    self.columns = columns
    self.on_column = on_column
    self.stage_columns = tuple(stage_columns)
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
    """The device column of a replica that runs `block` (0: the head)."""
    return self._token_columns.get(block.path, 0)

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
    """Records a split `weight` of `block`, whose k-th variable lives on
    the replicas' device column `first_column + k`."""
    if block is not None:
      self._token_columns[block.path] = first_column
    for column, variable in enumerate(weight.variables):
      for key in (id(variable.value), id(keras_layers.storage(variable))):
        self._expert_variables[key] = weight
        self._columns_of[key] = first_column + column

  def weight_of(self, variable):
    """The `ExpertWeight` of an expert Keras variable."""
    return self._expert_variables[id(keras_layers.storage(variable))]

  def column_of(self, variable):
    """The device column holding an expert tf.Variable (its tensor column,
    its pipeline stage's device, else 0)."""
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
    missing = [r for r in range(self.groups.expert) if r not in by_rank]
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
    counter = self.drop_counters[block.path]
    dropped = tf.reduce_sum(tf.cast(tf.logical_not(kept), tf.float32))
    routed = tf.cast(tf.size(kept), tf.float32)
    counter.assign_add(tf.stack([dropped, routed]))


class ExpertSplitting:
  """What every expert-parallel `StrategyExtended` does: split the experts
  of MoE blocks over the expert group and report routing. Mixed into
  `ExpertParallelExtended` (a data-only mesh) and
  `tensor_extended.ExpertTensorParallelExtended` (data x tensor), whose
  `__init__` set `self._context` (a `MoEContext`)."""

  @property
  def context(self):
    return self._context

  def local_replica_ids(self):
    """Global ids of this worker's replicas, in local order."""
    replicas = self._mesh.replicas
    return [replicas.index(group) for group in self._local_groups]

  def column_scopes(self, block):
    """None (`block`'s experts on the replica heads), or a context per
    device holding them (per tensor column; its pipeline stage's device)
    placing new variables on that device of every replica."""
    del block
    return None

  def first_column(self, block):
    """The device column of every replica that runs `block` (and holds
    its first `column_scopes`' experts)."""
    del block
    return 0

  def checked_blocks(self, model, unsplit=False):
    """`model`'s (block, family) MoE blocks, each checked to fit the
    expert group (x the tensor columns); with `unsplit`, only those whose
    experts are not split yet.

    Raises:
      ValueError: the model has no MoE block, or a block whose experts or
        top-k do not fit the expert size.
    """
    blocks = families.moe_blocks(model)
    if not blocks:
      raise ValueError(
          f"Model {model.name!r} has no mixture-of-experts layer that "
          f"tfpar can split (known: "
          f"{', '.join(f.name for f in families.FAMILIES)}); use "
          f"tfpar.DataParallelStrategy for it.")
    for block, family in blocks:
      check_block(block, self._context.groups.expert, self._context.columns)
      check_layout(block, family)
    return [(block, family) for block, family in blocks
            if not (unsplit and getattr(block, "_tfpar_experts_split", False))]

  def expert_weight_paths(self, model, unsplit=False):
    """Paths of the expert weights of `model`'s `checked_blocks`: the
    weights this layout splits, which the other parallelism of the mesh
    must leave where they were created."""
    return frozenset(
        getattr(block.expert_bank, name).path
        for block, family in self.checked_blocks(model, unsplit)
        for name in family.expert_weight_names)

  def split_experts(self, model):
    """Splits the experts of every MoE block of a built model.

    Raises:
      ValueError: the model has no MoE block, or a block whose experts or
        top-k do not fit the expert size.
    """
    blocks = self.checked_blocks(model, unsplit=True)
    optimizer = getattr(model, "optimizer", None)
    if blocks and optimizer is not None and optimizer.built:
      raise ValueError(
          f"The optimizer of model {model.name!r} was built before its "
          f"experts were split. Build the model inside strategy.scope() "
          f"before compiling it.")
    ranks = [self._context.groups.expert_rank(r)
             for r in self.local_replica_ids()]
    with self._container_strategy().scope():
      for block, family in blocks:
        bank = block.expert_bank
        for name in family.expert_weight_names:
          variable = getattr(bank, name)
          weight = variables_lib.split_expert_weight(
              variable, ranks, self._context.groups.expert,
              self.column_scopes(block))
          weight.gather = whole_experts.reader(self._context, weight)
          variables_lib.replace(bank, variable, weight)
          self._context.register(weight, block, self.first_column(block))
        with tf.init_scope():
          self._context.drop_counters[block.path] = tf.Variable(
              tf.zeros([2]), trainable=False,
              synchronization=tf.VariableSynchronization.ON_READ,
              aggregation=tf.VariableAggregation.SUM,
              name=f"{block.name}_dropped_routed")
        object.__setattr__(block, "call",
                           layers.build_call(block, family, self._context))
        object.__setattr__(block, "_tfpar_experts_split", True)
    object.__setattr__(model, "_tfpar_experts_split", True)
    whole_weights.install(model)

  def routing_report(self):
    """{MoE block path: (dropped assignments, routed assignments)} since
    the strategy started, summed over this worker's replicas."""
    report = {}
    for path, counter in self._context.drop_counters.items():
      total = np.sum([np.asarray(c.numpy()) for c in components(counter)],
                     axis=0)
      report[path] = (int(total[0]), int(total[1]))
    return report


class ExpertParallelExtended(ExpertSplitting, engine_extended.MeshExtended):
  """The logic of `tfpar.ExpertParallelStrategy` on a data-only mesh.

  Args:
    container_strategy: the public strategy.
    mesh: a data-only `tfpar.Mesh`.
    expert: the expert-group size (divides the data size).
    capacity_factor: None or a positive number (see `routing.capacity`).
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.
  """

  def __init__(self, container_strategy, mesh, expert, capacity_factor,
               communication_options=None):
    groups = groups_lib.ExpertGroups(mesh.num_replicas, expert)
    super().__init__(container_strategy, mesh, communication_options)
    self._context = MoEContext(self, groups, capacity_factor)

  preparation = "split its experts, so they would stay replicated"

  def is_prepared(self, model):
    return getattr(model, "_tfpar_experts_split", False)

  def prepare_model(self, model):
    if not self.is_prepared(model) and model.built:
      self.split_experts(model)
    if self.is_prepared(model) and getattr(model, "optimizer", None):
      optimizer_lib.adopt(model.optimizer, self._context, clip_model=model)


def check_block(block, expert, tensor=1):
  """Raises unless `block`'s experts and top-k fit the expert size (times
  the tensor size under expert x tensor, whose devices each hold
  num_experts / (expert x tensor) experts)."""
  num_experts, top_k = block.num_experts, block.top_k
  fits = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
  if num_experts % expert:
    raise ValueError(
        f"Layer {block.path!r}: num_experts={num_experts} is not divisible "
        f"by expert={expert}, so its experts cannot be split evenly over "
        f"the expert group. Use an expert size in {fits} that divides the "
        f"data size.")
  if num_experts % (expert * tensor):
    raise ValueError(
        f"Layer {block.path!r}: num_experts={num_experts} is not divisible "
        f"by expert x tensor = {expert} x {tensor}: under expert x tensor "
        f"each of the {expert * tensor} devices of an expert group holds "
        f"whole experts, num_experts / (expert x tensor) of them. Use "
        f"expert x tensor in {fits}.")
  if not 1 <= top_k <= num_experts:
    raise ValueError(
        f"Layer {block.path!r}: top_k={top_k} must be between 1 and "
        f"num_experts={num_experts} (each token picks top_k distinct "
        f"experts).")


def check_layout(block, family):
  """Raises if keras-hub moved the weights tfpar reads (an upgrade)."""
  wanted = [("block", block, family.router or keras_hub_names.MOE_ROUTER),
            ("block", block, "expert_bank")]
  bank = getattr(block, "expert_bank", None)
  wanted += [("expert bank", bank, name)
             for name in family.expert_weight_names]
  missing = [f"{where}.{name}" for where, owner, name in wanted
             if owner is None or not hasattr(owner, name)]
  if missing:
    raise ValueError(
        f"Layer {block.path!r} ({type(block).__name__}) lacks "
        f"{', '.join(missing)}: this keras-hub version lays out its MoE "
        f"block differently from the one tfpar knows, so its experts "
        f"cannot be split.")
