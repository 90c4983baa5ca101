"""What an expert-parallel model's optimizer does differently.

* The gradients of the experts are summed over the expert-data group (the
  replicas holding the same experts), not over every replica.
* Its saved state (`save_own_variables`, used by `model.save`) holds each
  expert weight's slots whole ([num_experts, ...]), as one device has them:
  the slot's component on each replica holds that replica's experts only.
"""

import tensorflow as tf

from tfpar._compat import keras_optimizers
from tfpar.common.clipping import clips
from tfpar.engine import whole_state
from tfpar.expert_parallel import clipping
from tfpar.expert_parallel import comm
from tfpar.expert_parallel import variables as variables_lib
from tfpar.expert_parallel import whole_experts


def adopt(optimizer, context, items=None, clip_model=None):
  """Makes `optimizer` reduce expert gradients over expert-data groups.

  Args:
    optimizer: a Keras optimizer of a model prepared by
      `ExpertParallelStrategy`.
    context: the strategy's `MoEContext` (which variables are experts).
    items: None, or a function giving the optimizer's variables as saved
      before the experts' slots are made whole (under expert x tensor,
      tensor parallelism's logical entries, its split slots whole).
    clip_model: None (Keras clips, if at all, each replica's gradients),
      or the model: clipping happens after the sums, by whole weights'
      norms as on one device (`tfpar.expert_parallel.clipping`).
  """
  if getattr(optimizer, "_tfpar_experts_adopted", False):
    return
  # Under mixed_float16 Keras compiles a LossScaleOptimizer, whose inner
  # optimizer sums the (unscaled) gradients over replicas.
  summing = getattr(optimizer, "inner_optimizer", optimizer)
  original = keras_optimizers.all_reduce_sum_gradients(summing)

  def all_reduce_sum_gradients(grads_and_vars):
    pairs = list(grads_and_vars)
    replica = context.replica_id()
    experts = [i for i, (g, v) in enumerate(pairs)
               if g is not None and context.is_expert_variable(v)]
    if replica is None or not experts:
      return original(pairs)
    chosen = set(experts)
    others = [p for i, p in enumerate(pairs) if i not in chosen]
    reduced_others = iter(original(others)) if others else iter(())
    # Under expert x tensor each tensor column's experts are summed by a
    # collective of that column's devices.
    by_column = {}
    for i in experts:
      by_column.setdefault(context.column_of(pairs[i][1]), []).append(i)
    summed = {}
    for column, indices in by_column.items():
      grads = [tf.convert_to_tensor(pairs[i][0]) for i in indices]
      summed.update(zip(indices, comm.sum_over_expert_data_group(
          grads, context.launchers.expert_data(replica, column), "experts")))
    return [(summed[i], v) if i in chosen else next(reduced_others)
            for i, (_, v) in enumerate(pairs)]

  if clip_model is not None and clips(summing):
    clipping.install(summing, context, clip_model, all_reduce_sum_gradients)
  else:
    keras_optimizers.replace_all_reduce_sum_gradients(
        summing, all_reduce_sum_gradients)
  _install_whole_slot_saving(optimizer, context, items)
  _checkpoint_whole_slots_once_built(optimizer, context)
  object.__setattr__(optimizer, "_tfpar_experts_adopted", True)


def whole_entries(optimizer, context, items=None):
  """The optimizer's variables (or `items`), each slot of an expert weight
  as an `ExpertWeight` (whole) view, in the optimizer's order."""
  prefixes = {weight.variable.path.replace("/", "_") + "_": weight
              for weight in context.expert_weights()}
  items = optimizer.variables if items is None else items
  found = []
  for item in items:
    name = getattr(item, "name", "")
    weight = next((w for p, w in prefixes.items() if name.startswith(p)),
                  None)
    if weight is None or tuple(item.shape) != tuple(weight.variable.shape):
      found.append(item)
      continue
    view = variables_lib.ExpertWeight(item.path, item, weight.ranks,
                                      weight.expert)
    view.gather = whole_experts.reader(context, view)
    found.append(view)
  return found


def _checkpoint_whole_slots_once_built(optimizer, context):
  """`tf.train.Checkpoint` saves each expert slot whole (as the weights)."""

  def install():
    for entry in whole_entries(optimizer, context):
      if isinstance(entry, variables_lib.ExpertWeight):
        variables_lib.checkpoint_whole(entry.variable, entry.ranks,
                                       entry.expert)

  if optimizer.built:
    install()
    return
  build = optimizer.build

  def build_then_install(variables):
    build(variables)
    install()

  object.__setattr__(optimizer, "build", build_then_install)


def _install_whole_slot_saving(optimizer, context, items=None):
  whole_state.save_whole_state(
      optimizer, lambda: whole_entries(
          optimizer, context, None if items is None else items()))
