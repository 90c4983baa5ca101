"""What a tensor-parallel model's optimizer does differently.

* Its checkpoints hold whole logical slots (the Adam moments of a split
  weight as one tensor), so they load into any tensor size.
* It clips gradients after the cross-replica all-reduce and by the norms of
  whole logical weights, which is what one device computes. (Keras clips
  each replica's partial gradient before the all-reduce, and would clip each
  shard by its own norm.)
"""

import warnings

import numpy as np
from keras.src.optimizers import base_optimizer
from keras import ops

from tfpar.tensor_parallel.variables import sharded_weights


class _LogicalSlot:
  """The whole-weight view of one optimizer slot of a sharded weight."""

  def __init__(self, slots, axis):
    self.slots, self.axis = slots, axis

  def numpy(self):
    return np.concatenate([s.numpy() for s in self.slots], self.axis)

  def assign(self, value):
    for slot, piece in zip(self.slots,
                           np.split(np.asarray(value), len(self.slots),
                                    self.axis)):
      slot.assign(piece)


def _logical_optimizer_entries(optimizer, weights):
  """The optimizer's variables in the order an unsharded model's optimizer
  has them: the per-shard slots of a weight become one whole slot."""
  prefixes = {}
  for weight in weights.values():
    for index, shard in enumerate(weight.shards):
      prefixes[shard.path.replace("/", "_") + "_"] = (weight, index)
  groups, entries = {}, []
  for variable in optimizer.variables:
    owner = next(((w, i, variable.name[len(p):]) for p, (w, i)
                  in prefixes.items() if variable.name.startswith(p)), None)
    if owner is None:
      entries.append(variable)
      continue
    weight, index, slot_name = owner
    key = (weight.path, slot_name)
    if key not in groups:
      groups[key] = [None] * len(weight.shards)
      entries.append(_LogicalSlot(groups[key], weight.axis))
    groups[key][index] = variable
  return entries


def adopt(optimizer, model):
  """Makes `optimizer` save logical slots and clip like one device.

  Args:
    optimizer: the Keras optimizer of `model`, not yet built.
    model: the sharded model.
  """
  if getattr(optimizer, "_tfpar_adopted", False):
    return
  _install_logical_saving(optimizer, model)
  _install_logical_clipping(optimizer, model)
  object.__setattr__(optimizer, "_tfpar_adopted", True)


def _install_logical_saving(optimizer, model):

  def save_own_variables(store):
    entries = _logical_optimizer_entries(optimizer, sharded_weights(model))
    for index, entry in enumerate(entries):
      store[str(index)] = np.asarray(entry.numpy())

  def load_own_variables(store):
    entries = _logical_optimizer_entries(optimizer, sharded_weights(model))
    if len(store.keys()) != len(entries):
      warnings.warn(
          f"Skipping variable loading for optimizer {optimizer.name!r}: it "
          f"has {len(entries)} logical variables and the checkpoint "
          f"{len(store.keys())}. Build the optimizer first "
          f"(optimizer.build(model.trainable_variables)).", stacklevel=2)
      return
    for index, entry in enumerate(entries):
      entry.assign(store[str(index)])

  object.__setattr__(optimizer, "save_own_variables", save_own_variables)
  object.__setattr__(optimizer, "load_own_variables", load_own_variables)


def _shard_groups(model):
  """{id of a shard's tf.Variable: (logical path, shard count)}."""
  groups = {}
  for weight in sharded_weights(model).values():
    for shard in weight.shards:
      groups[id(shard._value)] = weight.path  # pylint: disable=protected-access
  return groups


def _install_logical_clipping(optimizer, model):
  original_all_reduce = optimizer._all_reduce_sum_gradients  # pylint: disable=protected-access
  if not (optimizer.clipnorm or optimizer.global_clipnorm or
          optimizer.clipvalue):
    return

  def clip_gradients(grads):
    return grads  # Clipped after the all-reduce instead.

  def all_reduce_then_clip(grads_and_vars):
    pairs = list(original_all_reduce(grads_and_vars))
    grads = [g for g, _ in pairs]
    if optimizer.clipnorm and optimizer.clipnorm > 0:
      groups = _shard_groups(model)
      keys = [groups.get(id(v), id(v)) for _, v in pairs]
      sums = {}
      for key, grad in zip(keys, grads):
        if grad is not None:
          sums[key] = sums.get(key, 0.0) + ops.sum(ops.square(grad))
      grads = [None if g is None else _clip(g, sums[k], optimizer.clipnorm)
               for g, k in zip(grads, keys)]
    elif optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
      grads = base_optimizer.clip_by_global_norm(grads,
                                                 optimizer.global_clipnorm)
    elif optimizer.clipvalue and optimizer.clipvalue > 0:
      v = optimizer.clipvalue
      grads = [None if g is None else ops.clip(g, -v, v) for g in grads]
    return [(g, v) for g, (_, v) in zip(grads, pairs)]

  object.__setattr__(optimizer, "_clip_gradients", clip_gradients)
  object.__setattr__(optimizer, "_all_reduce_sum_gradients",
                     all_reduce_then_clip)


def _clip(grad, square_sum, clipnorm):
  """Keras's `_clip_by_norm` with the norm of the whole logical weight."""
  positive = square_sum > 0
  norm = ops.where(positive, ops.sqrt(ops.where(positive, square_sum, 1.0)),
                   square_sum)
  return ops.multiply(grad, clipnorm) / ops.maximum(norm, clipnorm)


