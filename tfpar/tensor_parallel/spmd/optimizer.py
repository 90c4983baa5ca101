"""What an SPMD tensor-parallel model's optimizer does differently.

* Its checkpoints (Keras files, `tf.train.Checkpoint`) hold whole slots
  (`weights.adopt_optimizer`; under
  `tfpar.ZeRO`, ZeRO's own, column by column: `zero_hooks.py`).
* The gradients of replicated weights that are partial on each device
  (applied to sequence slices; key/value heads shared by several devices)
  are summed over the tensor group first (`sequence.sum_partial_gradients`).
* Under loss scaling (`mixed_float16`) every device of every group skips
  the same steps: each device holds other gradients (its shards', or its
  slices' partial sums), so an overflow on one device must stop the
  update on all of them, as it stops one device's update.
"""

from keras import ops
import numpy as np
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat import keras_optimizers
from tfpar.common import instrument
from tfpar.common.clipping import clip_by_norm_of
from tfpar.common.clipping import clips
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel.spmd import sequence
from tfpar.tensor_parallel.spmd import weights


def adopt(optimizer, model, groups, partial_weights):
  """Adapts a model's optimizer to the SPMD strategy (idempotent).

  Args:
    optimizer: the model's Keras optimizer (a `LossScaleOptimizer` or not).
    model: the sharded model.
    groups: the strategy's `collectives.TensorGroups`.
    partial_weights: the `Memo`'s weights with partial gradients.
  """
  if getattr(optimizer, "_tfpar_zero", None) is None:
    weights.adopt_optimizer(optimizer, model)  # ZeRO saves whole slots.
  inner = getattr(optimizer, "inner_optimizer", None)
  # The inner optimizer of a LossScaleOptimizer sums the gradients.
  sequence.sum_partial_gradients(inner or optimizer, groups, partial_weights)
  _clip_over_group(inner or optimizer, model, groups)
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


def _square_sum(grad):
  """Sum of squares as Keras's clipping takes it."""
  return ops.sum(ops.square(grad))


def _clip_over_group(optimizer, model, groups):
  """Makes `optimizer` (the one that sums the gradients) clip after the
  all-reduce, by whole-weight norms summed over the tensor group."""
  if not clips(optimizer) or getattr(optimizer, "_tfpar_spmd_clips", False):
    return
  all_reduce = keras_optimizers.all_reduce_sum_gradients(optimizer)

  def over_group(value, what):
    if collectives.current_slot() is None:  # Not in a step: no group.
      return value
    return collectives.all_reduce(groups, value, what, instrument.BACKWARD)

  def all_reduce_then_clip(grads_and_vars):
    pairs = list(all_reduce(grads_and_vars))
    split = {id(keras_layers.storage(w.variable))
             for w in weights.spmd_weights(model).values()}
    present = [(i, g, id(v) in split) for i, (g, v) in enumerate(pairs)
               if g is not None]
    grads = [g for g, _ in pairs]
    if not present:
      return pairs
    squares = [_square_sum(g) for _, g, _ in present]
    if optimizer.clipnorm and optimizer.clipnorm > 0:
      shards = [k for k, (_, _, is_split) in enumerate(present) if is_split]
      if shards:
        summed = tf.unstack(over_group(tf.stack([squares[k] for k in shards]),
                                       "clipnorm"))
        for k, total in zip(shards, summed):
          squares[k] = total
      for (i, g, _), total in zip(present, squares):
        grads[i] = clip_by_norm_of(g, total, optimizer.clipnorm)
    elif optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
      replicated = [q for q, (_, _, s) in zip(squares, present) if not s]
      split_squares = [q for q, (_, _, s) in zip(squares, present) if s]
      total = ops.sum(ops.stack(replicated)) if replicated else 0.0
      if split_squares:
        total += over_group(ops.sum(ops.stack(split_squares)),
                            "global_clipnorm")
      norm = ops.sqrt(total)
      clip = optimizer.global_clipnorm
      scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
      for i, g, _ in present:  # As Keras: a sparse gradient made dense.
        grads[i] = g * scale
    else:
      value = optimizer.clipvalue
      for i, g, _ in present:
        grads[i] = ops.clip(g, -value, value)
    return [(g, v) for g, (_, v) in zip(grads, pairs)]

  keras_optimizers.clip_after_all_reduce(optimizer, all_reduce_then_clip)
  object.__setattr__(optimizer, "_tfpar_spmd_clips", True)


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
