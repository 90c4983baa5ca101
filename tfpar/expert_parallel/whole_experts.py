"""Whole expert weights whose ranks live on several workers.

When an expert group spans `TF_CONFIG` workers, each worker holds only its
replicas' experts. Reading a whole `[num_experts, ...]` weight
(`get_weights`, `tfpar.save_weights`) then gathers every replica's experts
with one all-gather over all replicas: a collective, so every worker must
read the same weights in the same order, as TensorFlow requires of every
multi-worker save. `prefetched(model)` gathers all of a model's split
experts at once (what `tfpar.save_weights` does on every worker before the
chief writes); outside it each read gathers its own weight.
"""

import contextlib

import numpy as np
import tensorflow as tf

from tfpar import watchdog
from tfpar._compat import distribute
from tfpar._compat import keras_layers
from tfpar._compat import spmd_run

_prefetched = {}  # id of an expert variable -> its whole NumPy value


def gather(context, weights):
  """The whole values of `weights` (`ExpertWeight`s), gathered from every
  replica (a collective over all workers).

  Args:
    context: the strategy's `MoEContext`.
    weights: `ExpertWeight`s, the same on every worker, in the same order.
  """
  values = [keras_layers.storage(w.variable) for w in weights]
  strategy = values[0].distribute_strategy

  def on_replica():
    column = context.current_column()
    launcher = context.launchers.everyone(context.replica_id(), column)
    # In a replica context a variable reads as the replica's (under SPMD
    # the device's) experts.
    gathered = [distribute.all_gather(launcher, tf.convert_to_tensor(v))
                for v in values]
    if context.per_device:  # Every column's, on its group's first device.
      device = spmd_run.device_replica_id(
          tf.distribute.get_replica_context()).device_index
      tensor_launcher = context.tensor_groups.launcher(device)
      gathered = [distribute.all_gather(tensor_launcher, g) for g in gathered]
    return gathered

  with watchdog.watching(strategy, "the gather of whole expert weights"):
    gathered = tf.function(lambda: strategy.run(on_replica))()
  groups = context.groups
  first_of_rank = {}
  for replica in range(strategy.num_replicas_in_sync):
    first_of_rank.setdefault(groups.expert_rank(replica), replica)
  wholes = []
  columns = context.tensor_groups.tensor_size if context.per_device else 1
  for per_replica in gathered:
    flat = strategy.experimental_local_results(per_replica)[0].numpy()
    # [column][replica][its experts], each column's gathered over replicas.
    pieces = flat.reshape((columns, strategy.num_replicas_in_sync, -1) +
                          flat.shape[1:])
    wholes.append(np.concatenate(
        [pieces[column, first_of_rank[rank]] for rank in range(groups.expert)
         for column in range(columns)], 0))
  return wholes


def reader(context, weight):
  """A function giving `weight`'s whole value: prefetched, or gathered
  now."""
  def read():
    found = _prefetched.get(id(weight.variable))
    return found if found is not None else gather(context, [weight])[0]
  return read


@contextlib.contextmanager
def prefetched(model):
  """Gathers, on every worker, the whole values of `model`'s expert weights
  and optimizer slots that span workers, and serves them to every read
  inside the block; does nothing for other models.

  Args:
    model: a Keras model (every worker passes its copy).
  """
  strategy = getattr(model, "distribute_strategy", None)
  context = getattr(getattr(strategy, "extended", None), "context", None)
  weights = [] if not hasattr(context, "saved_expert_weights") else [
      w for w in context.saved_expert_weights(model) if w.spans_workers()]
  if weights:
    for weight, value in zip(weights, gather(context, weights)):
      _prefetched[id(weight.variable)] = value
  try:
    yield
  finally:
    for weight in weights:
      _prefetched.pop(id(weight.variable), None)
