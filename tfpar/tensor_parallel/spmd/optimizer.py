"""What an SPMD tensor-parallel model's optimizer does differently.

* Its checkpoints hold whole slots (`weights.adopt_optimizer`).
* With sequence parallelism, the gradients of weights applied to sequence
  slices are summed over the tensor group first
  (`sequence.sum_partial_gradients`).
* Under loss scaling (`mixed_float16`) every device of every group skips
  the same steps: each device holds other gradients (its shards', or its
  slices' partial sums), so an overflow on one device must stop the
  update on all of them, as it stops one device's update.
"""

import numpy as np
import tensorflow as tf

from tfpar.common import instrument
from tfpar.tensor_parallel.spmd import collectives
from tfpar.tensor_parallel.spmd import sequence
from tfpar.tensor_parallel.spmd import weights


def adopt(optimizer, model, groups, slices=None):
  """Adapts a model's optimizer to the SPMD strategy (idempotent).

  Args:
    optimizer: the model's Keras optimizer (a `LossScaleOptimizer` or not).
    model: the sharded model.
    groups: the strategy's `collectives.TensorGroups`.
    slices: the strategy's `sequence.Slices`, or None without sequence
      parallelism.
  """
  weights.adopt_optimizer(optimizer, model)
  inner = getattr(optimizer, "inner_optimizer", None)
  if slices is not None:
    # The inner optimizer of a LossScaleOptimizer sums the gradients.
    sequence.sum_partial_gradients(inner or optimizer, slices)
  if inner is not None:
    _overflow_over_group(optimizer, groups)


def _overflow_over_group(optimizer, groups):
  if getattr(optimizer, "_tfpar_spmd_overflow", False):
    return
  check_finite = type(optimizer).check_finite  # tfpar's: over the replicas.

  def check(grads):
    finite = check_finite(optimizer, grads)
    if collectives.current_slot() is None:
      return finite
    overflows = collectives.all_reduce(
        groups, tf.cast(tf.logical_not(finite), tf.float32), "loss scale",
        instrument.BACKWARD)
    return tf.equal(overflows, 0.0)

  object.__setattr__(optimizer, "check_finite", check)
  object.__setattr__(optimizer, "_tfpar_spmd_overflow", True)


def rebuild_for_shards(model):
  """Replaces `model.optimizer`, built for the weights before sharding
  (`keras.models.load_model` in the strategy's scope), by a twin built for
  the SPMD shards that carries over its whole state.

  Args:
    model: a model just sharded whose optimizer is built.

  Raises:
    ValueError: the twin's whole state does not match the old one's.
  """
  old = model.optimizer
  state = [np.asarray(v.numpy()) for v in old.variables]
  new = type(old).from_config(old.get_config())
  new.build(model.trainable_variables)
  entries = weights.optimizer_entries(new, model)
  if len(entries) != len(state):
    raise ValueError(
        f"Cannot carry the state of optimizer {old.name!r} over to the "
        f"sharded model: it had {len(state)} variables, its sharded twin "
        f"{len(entries)}.")
  for entry, value in zip(entries, state):
    entry.assign(value)
  model.optimizer = new
