"""Expert weights split over the expert group.

An MoE layer's expert weight [E, ...] becomes a variable of shape
[E / expert, ...] created in the strategy's scope (one component on each
replica's head, as any replicated weight), whose component on replica r
holds the experts of r's expert rank. Keras's optimizer creates its slots
next to it, and `extended.update` applies each replica's own (reduced)
gradient to its own component, so the experts of different ranks train
apart while replicas of the same rank stay equal.

Under expert x tensor the weight becomes one such variable per tensor
column k, of shape [E / (expert * tensor), ...], on the k-th device of
every replica (`split_expert_weight`'s `column_scopes`).

`ExpertWeight` is the whole weight: it reads and assigns the [E, ...]
tensor, which `tfpar.logical_weights` and `save_weights` use.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfpar._compat import checkpointing
from tfpar._compat import keras_layers
from tfpar.common import piece_terms
from tfpar.common import split_weights
from tfpar.memory import components


class ExpertWeight:
  """The whole [num_experts, ...] view of an expert weight split over the
  expert group.

  Args:
    path: the original weight's path.
    variables: the Keras variable of the local experts, or under
      expert x tensor one per tensor column (variable k on the k-th device
      of every replica).
    ranks: the expert rank of each of their components (local replicas).
    expert: the expert-group size.

  The experts are split into `expert x columns` equal slots, rank-major:
  the component of column k on a replica of expert rank j holds slot
  `j * columns + k`.

  Example:

  >>> weight = ExpertWeight("moe/w", keras.Variable(np.ones((2, 3))), [0], 1)
  >>> weight.numpy().shape
  (2, 3)
  """

  def __init__(self, path, variables, ranks, expert):
    self.path = path
    if not isinstance(variables, (list, tuple)):
      variables = [variables]
    self.variables = tuple(variables)
    self._ranks = tuple(ranks)
    self._expert = expert
    # Reads the whole weight when some ranks live on other workers (a
    # collective; set by the strategy, `whole_experts.reader`).
    self.gather = None

  @property
  def variable(self):
    """The variable of the first (or only) column."""
    return self.variables[0]

  @property
  def columns(self):
    return len(self.variables)

  @property
  def shape(self):
    local = tuple(self.variable.shape)
    return (local[0] * self._expert * self.columns,) + local[1:]

  ranks = property(lambda self: self._ranks)
  expert = property(lambda self: self._expert)
  dtype = property(lambda self: self.variable.dtype)
  trainable = property(lambda self: self.variable.trainable)
  name = property(lambda self: self.path.split("/")[-1])

  def components_by_rank(self):
    """{expert rank: the first local component holding its experts} (of
    the first column)."""
    return {rank: parts[0] for rank, parts in self._parts_by_rank().items()}

  def _parts_by_rank(self):
    """{expert rank: [its component of each column]}."""
    found = {}
    columns = [components(v) for v in self.variables]
    for position, rank in enumerate(self._ranks):
      found.setdefault(rank, [parts[position] for parts in columns])
    return found

  def spans_workers(self):
    """Whether some expert ranks live on other workers only."""
    return len(self._parts_by_rank()) < self._expert

  def _missing(self):
    return sorted(set(range(self._expert)) - set(self._parts_by_rank()))

  def numpy(self):
    """The whole weight; when some ranks live on other workers, gathered
    from every worker (each must read the same weights in the same
    order)."""
    missing = self._missing()
    if missing and self.gather is not None:
      return self.gather()
    if missing:
      raise ValueError(
          f"Expert weight {self.path!r}: the experts of rank(s) {missing} "
          f"live on other workers, so the whole weight cannot be read here.")
    by_rank = self._parts_by_rank()
    return np.concatenate(
        [np.asarray(part.numpy()) for r in range(self._expert)
         for part in by_rank[r]], 0)

  def whole_tensor(self):
    """The whole weight as one tensor (every rank on this worker)."""
    missing = self._missing()
    if missing:
      raise ValueError(
          f"Expert weight {self.path!r}: the experts of rank(s) {missing} "
          f"live on other workers (the expert groups span workers).")
    by_rank = self._parts_by_rank()
    return tf.concat([tf.convert_to_tensor(part) for r in range(self._expert)
                      for part in by_rank[r]], 0)

  def assign(self, value):
    """Sets the whole weight: each component takes its slot's experts."""
    value = np.asarray(value)
    if tuple(value.shape) != self.shape:
      raise ValueError(f"Cannot assign a value of shape {value.shape} to "
                       f"expert weight {self.path!r} of shape {self.shape}.")
    pieces = np.split(value, self._expert * self.columns, axis=0)
    for column, variable in enumerate(self.variables):
      for rank, component in zip(self._ranks, components(variable)):
        component.assign(pieces[rank * self.columns + column])

  def __repr__(self):
    tensor = f" x tensor={self.columns}" if self.columns > 1 else ""
    return (f"<ExpertWeight path={self.path} shape={self.shape} "
            f"split over expert={self._expert}{tensor}>")


def split_expert_weight(variable, ranks, expert, column_scopes=None):
  """A variable holding `variable`'s experts of each local replica's rank
  (one per tensor column under expert x tensor).

  Call in the strategy's scope, outside any replica context.

  Args:
    variable: the built layer's Keras variable [num_experts, ...].
    ranks: the expert rank of each local replica, in replica order.
    expert: the expert-group size.
    column_scopes: None (the variable lives on the replica heads), or one
      context per tensor column that places new variables on that column's
      device of every replica; the experts are then split into
      `expert x len(column_scopes)` slots (rank-major). A single context
      (a pipeline stage's device) only places the variable.

  Returns:
    An `ExpertWeight` whose `variables` replace `variable` in its layer.
  """
  if getattr(variable, "regularizer", None) is not None:
    # Each rank's replicas would add its experts' term to a loss averaged
    # over all replicas: 1/expert of one device's.
    raise ValueError(
        f"Expert weight {variable.path!r} has a regularizer "
        f"({type(variable.regularizer).__name__}); expert parallelism does "
        f"not apply weight regularizers to split experts yet. Remove it or "
        f"train without an expert axis.")
  piece_terms.check_splittable(variable, 0)  # Its constraint.
  whole = np.asarray(variable.numpy())
  storage = keras_layers.storage(variable)
  if hasattr(storage, "release"):  # Created spread (tensor parallelism).
    storage.release()
  columns = 1 if column_scopes is None else len(column_scopes)
  pieces = np.split(whole, expert * columns, axis=0)
  made = []
  for column in range(columns):
    suffix = "_experts" if columns == 1 else f"_experts{column}"
    scope = (contextlib.nullcontext() if column_scopes is None
             else column_scopes[column])
    with tf.init_scope(), scope:
      local = keras.Variable(pieces[ranks[0] * columns + column],
                             dtype=variable.dtype,
                             trainable=variable.trainable,
                             name=f"{variable.name}{suffix}")
      keras_layers.set_path(local, f"{variable.path}{suffix}")
      parts = components(local)
      if len(parts) != len(ranks):
        raise ValueError(
            f"Expert weight {variable.path!r} got {len(parts)} component(s) "
            f"for {len(ranks)} local replica(s).")
      for rank, component in zip(ranks, parts):
        component.assign(pieces[rank * columns + column])
    made.append(local)
  piece_terms.carry_over(variable, made)
  weight = ExpertWeight(variable.path, made, ranks, expert)
  for column, local in enumerate(made):
    if columns == 1:
      checkpoint_whole(local, ranks, expert)
    else:
      refuse_checkpoint(local)
    # Keras's get_weights / set_weights speak whole weights
    # (`tfpar.common.whole_weights`): the local variables are the
    # "shards" of their whole weight.
    local._tfpar_shard_of = (weight, column)  # pylint: disable=protected-access
  return weight


def refuse_checkpoint(variable):
  """Makes `tf.train.Checkpoint` refuse `variable`, one tensor column's
  experts under expert x tensor (saving it alone would write a part of a
  weight under the whole weight's key)."""

  def refuse(*unused):
    raise ValueError(
        f"tf.train.Checkpoint cannot save or restore expert weight "
        f"{variable.path!r} under expert x tensor parallelism yet. Use "
        f"model.save_weights / model.save or tfpar.save_weights, which "
        f"write whole weights.")

  checkpointing.override_saved_tensors(variable, refuse, refuse)


def checkpoint_whole(variable, ranks, expert):
  """Makes `tf.train.Checkpoint` save `variable` (a Keras variable whose
  component on each local replica holds that replica's experts, or their
  optimizer slots) as the whole [num_experts, ...] tensor, and restore each
  component's experts from it. TF saves a distributed variable's first
  component alone, which here would be the experts of rank 0 only.

  Args:
    variable: a Keras variable of local experts.
    ranks: the expert rank of each of its components.
    expert: the expert-group size.
  """
  whole = ExpertWeight(variable.path, variable, ranks, expert)

  def serialize_to_tensors():
    by_rank = whole.components_by_rank()
    missing = sorted(set(range(expert)) - set(by_rank))
    if missing:
      raise ValueError(
          f"tf.train.Checkpoint cannot save expert weight {variable.path!r} "
          f"from this worker: the experts of rank(s) {missing} live on other "
          f"workers. Use tfpar.save_weights(model, path).")
    return {"VARIABLE_VALUE": tf.concat(
        [tf.convert_to_tensor(by_rank[r]) for r in range(expert)], 0)}

  def restore_from_tensors(restored_tensors):
    pieces = tf.split(restored_tensors["VARIABLE_VALUE"], expert, axis=0)
    return tf.group([component.assign(pieces[rank]) for rank, component
                     in zip(ranks, components(variable))])

  checkpointing.override_saved_tensors(variable, serialize_to_tensors,
                                       restore_from_tensors)


def replace(owner, variable, weight):
  """Puts `weight.variable` where `variable` was in `owner`'s variable
  lists and attributes, and `weight` in its logical order (whole weights
  for `tfpar.logical_weights` and `save_weights`)."""
  split_weights.record_logical_weight(owner, variable, weight)
  for store in keras_layers.variable_lists(owner):
    for position, item in enumerate(store):
      if item is variable:
        store[position:position + 1] = list(weight.variables)
        break
  for attribute, value in list(vars(owner).items()):
    if value is variable:
      object.__setattr__(owner, attribute, weight.variable)
      # tf.train.Checkpoint follows tracked attributes: without this the
      # whole variable stays tracked, alive on every device.
      keras_layers.track(owner, weight.variable, attribute)
  # Saves and loads `owner`'s logical order (whole weights), as tensor
  # parallelism does for its shards.
  split_weights.install_logical_saving(owner)
