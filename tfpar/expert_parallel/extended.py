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
  """

  def __init__(self, extended, groups, capacity_factor):
    self._extended = extended
    self.groups = groups
    self.capacity_factor = capacity_factor
    self._launchers = None
    self._expert_variables = {}  # id of tf variable -> ExpertWeight
    self.drop_counters = {}  # block path -> tf.Variable [dropped, routed]

  @property
  def launchers(self):
    if self._launchers is None:
      extended = self._extended
      heads = [group[0] for group in extended.mesh.replicas]
      self._launchers = groups_lib.Launchers(
          self.groups, heads, extended.local_replica_ids(),
          distribute.communication_options(extended))
    return self._launchers

  def replica_id(self):
    """This strategy's replica id in a replica context, else None."""
    strategy = distribute.container_strategy(self._extended)
    context = tf.distribute.get_replica_context()
    if (context is None or not tf.distribute.has_strategy() or
        tf.distribute.get_strategy() is not strategy):
      return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return None if replica is None else int(replica)

  def register(self, weight):
    self._expert_variables[id(weight.variable.value)] = weight

  def expert_weights(self):
    """Every `ExpertWeight` split so far."""
    return list(self._expert_variables.values())

  def saved_expert_weights(self, model):
    """`model`'s expert weights and its optimizer's expert slots, as whole
    `ExpertWeight` views, in the order saving reads them."""
    weights = [w for w in self.expert_weights()
               if any(w.variable is v for v in model.weights)]
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
    by_rank = weight.components_by_rank()
    missing = [r for r in range(self.groups.expert) if r not in by_rank]
    if missing and keras_modules.symbolic_scope.in_symbolic_scope():
      # Keras building the model symbolically: only shapes flow.
      piece = next(iter(by_rank.values()))
      return tf.zeros([self.groups.expert * piece.shape[0]] +
                      piece.shape[1:].as_list(), piece.dtype)
    if missing:
      raise ValueError(
          f"Calling the model outside the strategy's replicas needs the "
          f"whole expert weight {variable.path!r}, but the experts of rank(s) "
          f"{missing} live on other workers (the expert groups span "
          f"workers). Use fit / evaluate / predict, or strategy.run.")
    return tf.concat([tf.convert_to_tensor(by_rank[r])
                      for r in range(self.groups.expert)], 0)

  def count_drops(self, block, kept):
    counter = self.drop_counters[block.path]
    dropped = tf.reduce_sum(tf.cast(tf.logical_not(kept), tf.float32))
    routed = tf.cast(tf.size(kept), tf.float32)
    counter.assign_add(tf.stack([dropped, routed]))


class ExpertParallelExtended(engine_extended.MeshExtended):
  """The logic of `tfpar.ExpertParallelStrategy`.

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

  @property
  def context(self):
    return self._context

  def local_replica_ids(self):
    """Global ids of this worker's replicas, in local order."""
    replicas = self._mesh.replicas
    return [replicas.index(group) for group in self._local_groups]

  preparation = "split its experts, so they would stay replicated"

  def is_prepared(self, model):
    return getattr(model, "_tfpar_experts_split", False)

  def prepare_model(self, model):
    if not self.is_prepared(model) and model.built:
      self.split_experts(model)
    if self.is_prepared(model) and getattr(model, "optimizer", None):
      optimizer_lib.adopt(model.optimizer, self._context)

  def split_experts(self, model):
    """Splits the experts of every MoE block of a built model.

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
    expert = self._context.groups.expert
    for block, family in blocks:
      check_block(block, expert)
      check_layout(block, family)
    blocks = [(block, family) for block, family in blocks
              if not getattr(block, "_tfpar_experts_split", False)]
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
          weight = variables_lib.split_expert_weight(variable, ranks, expert)
          weight.gather = whole_experts.reader(self._context, weight)
          variables_lib.replace(bank, variable, weight)
          self._context.register(weight)
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


def check_block(block, expert):
  """Raises unless `block`'s experts and top-k fit the expert size."""
  num_experts, top_k = block.num_experts, block.top_k
  if num_experts % expert:
    fits = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
    raise ValueError(
        f"Layer {block.path!r}: num_experts={num_experts} is not divisible "
        f"by expert={expert}, so its experts cannot be split evenly over "
        f"the expert group. Use an expert size in {fits} that divides the "
        f"data size.")
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
