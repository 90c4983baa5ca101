"""Expert weights split over the expert group.

An MoE layer's expert weight [E, ...] becomes a variable of shape
[E / expert, ...] created in the strategy's scope (one component on each
replica's head, as any replicated weight), whose component on replica r
holds the experts of r's expert rank. Keras's optimizer creates its slots
next to it, and `extended.update` applies each replica's own (reduced)
gradient to its own component, so the experts of different ranks train
apart while replicas of the same rank stay equal.

Under expert x tensor the variable, of shape [E / (expert * tensor), ...],
has a component on every device of every replica, each holding its own
slot of the experts (`split_expert_weight`'s `placement`).

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
from tfpar.expert_parallel.expert_weight import ExpertWeight
from tfpar.memory import components


def split_expert_weight(variable, ranks, expert, placement=None):
  """A variable holding `variable`'s experts of each local component's
  slot.

  Call in the strategy's scope, outside any replica context.

  Args:
    variable: the built layer's Keras variable [num_experts, ...].
    ranks: the slot of each local component, in order (a local
      replica's expert rank; under expert x tensor, a device's slot).
    expert: the number of slots the experts are split into.
    placement: None (the variable lives where the strategy puts a
      variable), or a context placing it (a pipeline stage's device of
      every replica; every device under expert x tensor).

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
  pieces = np.split(whole, expert, axis=0)
  with tf.init_scope(), placement or contextlib.nullcontext():
    local = keras.Variable(pieces[ranks[0]], dtype=variable.dtype,
                           trainable=keras_layers.storage_trainable(variable),
                           name=f"{variable.name}_experts")
    local.trainable = variable.trainable
    keras_layers.set_path(local, f"{variable.path}_experts")
    parts = components(local)
    if len(parts) != len(ranks):
      raise ValueError(
          f"Expert weight {variable.path!r} got {len(parts)} component(s) "
          f"for {len(ranks)} local slot(s).")
    for rank, component in zip(ranks, parts):
      component.assign(pieces[rank])
  piece_terms.carry_over(variable, [local])
  weight = ExpertWeight(variable.path, local, ranks, expert)
  # The variable saves (and restores) the experts of every slot.
  checkpoint_whole(local, ranks, expert)
  # Keras's weight API speaks whole weights (`tfpar.common.whole_weights`):
  # the local variable is the one "shard" of its whole weight.
  local._tfpar_shard_of = (weight, 0)  # pylint: disable=protected-access
  return weight


def checkpoint_whole(variable, ranks, expert):
  """Makes `tf.train.Checkpoint` save `variable` (a Keras variable whose
  component on each local replica holds that replica's experts, or their
  optimizer slots) as the tensor of every slot's experts
  ([num_experts, ...]), and restore each component's experts from it. TF saves a distributed variable's first component alone, which here
  would be the experts of rank 0 only.

  Args:
    variable: a Keras variable of local experts.
    ranks: the expert rank of each of its components.
    expert: the expert-group size.
  """
  whole = ExpertWeight(variable.path, variable, ranks, expert)

  def serialize_to_tensors():
    missing = sorted(set(range(expert)) - set(whole.components_by_rank()))
    if missing:
      raise ValueError(
          f"tf.train.Checkpoint cannot save expert weight {variable.path!r} "
          f"from this worker: the experts of rank(s) {missing} live on other "
          f"workers. Use tfpar.save_weights(model, path).")
    return whole.saved_tensors()

  checkpointing.override_saved_tensors(variable, serialize_to_tensors,
                                       whole.restore_tensors)


def replace(owner, variable, weight):
  """Puts `weight.variables` where `variable` was in `owner`'s variable
  lists, `weight.variable` among its attributes, and `weight` in its
  logical order (whole weights for `tfpar.logical_weights` and
  `save_weights`). `tf.train.Checkpoint` sees the attribute's whole weight
  (the local variable saving every slot's experts)."""
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
