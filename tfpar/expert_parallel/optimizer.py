"""What an expert-parallel model's optimizer does differently: the
gradients of the experts are summed over the expert-data group (the
replicas holding the same experts), not over every replica."""

import tensorflow as tf

from tfpar.expert_parallel import comm


def adopt(optimizer, context):
  """Makes `optimizer` reduce expert gradients over expert-data groups.

  Args:
    optimizer: a Keras optimizer of a model prepared by
      `ExpertParallelStrategy`.
    context: the strategy's `MoEContext` (which variables are experts).
  """
  if getattr(optimizer, "_tfpar_experts_adopted", False):
    return
  original = optimizer._all_reduce_sum_gradients  # pylint: disable=protected-access

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
    grads = [tf.convert_to_tensor(pairs[i][0]) for i in experts]
    summed = iter(comm.sum_over_expert_data_group(
        grads, context.launchers.expert_data(replica), "experts"))
    return [(next(summed), v) if i in chosen else next(reduced_others)
            for i, (_, v) in enumerate(pairs)]

  object.__setattr__(optimizer, "_all_reduce_sum_gradients",
                     all_reduce_sum_gradients)
  object.__setattr__(optimizer, "_tfpar_experts_adopted", True)
