"""Turning a Keras optimizer into a ZeRO stage-1 optimizer.

Each trainable weight (flattened, padded to a multiple of N replicas) is
owned slice by slice: replica r keeps the optimizer state of slice r only,
in per-replica (`ON_READ`) variables of 1/N of the size. A step all-reduces
the gradients as data parallelism does, clips them as one device would,
updates each replica's slice with the optimizer's own `update_step` (so
every Keras optimizer whose state is elementwise works unchanged) and
all-gathers the updated slices into the weights.
"""

import math

import keras
from keras.src import backend
import numpy as np
import tensorflow as tf

# Optimizer variables that are not per-weight state kept by the update
# rule: they keep their full shape.
_UNSHARDED_SLOTS = ("gradient_accumulator", "average")
# Optimizers whose state is not elementwise in the weights.
_REFUSED = ("Adafactor",)


def _slice_size(variable, replicas):
  return max(1, math.ceil(int(np.prod(variable.shape)) / replicas))


def _on_read_variable(optimizer, shape, initializer, dtype, name):
  with backend.name_scope(optimizer.name, caller=optimizer):
    variable = backend.Variable(
        initializer=keras.initializers.get(initializer), shape=shape,
        dtype=dtype, trainable=False, aggregation="none",
        synchronization="on_read", name=name)
  optimizer._track_variable(variable)  # pylint: disable=protected-access
  return variable


def shard(optimizer, strategy):
  """Makes an unbuilt Keras optimizer keep 1/N of its state per replica.

  Args:
    optimizer: a Keras optimizer, not built yet.
    strategy: the `tf.distribute.Strategy` it runs under (N =
      `num_replicas_in_sync`).

  Raises:
    ValueError: the optimizer is built already, or its state is not
      elementwise (Adafactor).
  """
  if type(optimizer).__name__ in _REFUSED:
    raise ValueError(
        f"tfpar.ZeRO cannot shard {type(optimizer).__name__}: its state "
        f"(factored second moments) is not elementwise in the weights, so "
        f"slices of it would be wrong. Use it without ZeRO.")
  if optimizer.built:
    raise ValueError(
        f"tfpar.ZeRO needs optimizer {optimizer.name!r} unbuilt, so that "
        f"full-size state is never allocated; it is built already. Pass "
        f"the ZeRO callback to the first fit call of a freshly compiled "
        f"model.")
  if getattr(optimizer, "_distribution_strategy", strategy) is not strategy:
    raise ValueError(
        f"Optimizer {optimizer.name!r} was created outside the model's "
        f"strategy scope ({strategy!r}); create it (and compile the model) "
        f"inside strategy.scope() for tfpar.ZeRO to shard it.")
  replicas = strategy.num_replicas_in_sync
  state = {"proxies": {}, "slots": {}, "replicas": replicas}
  object.__setattr__(optimizer, "_tfpar_zero", state)
  original_from_reference = optimizer.add_variable_from_reference
  original_build = optimizer.build

  def add_variable_from_reference(reference_variable, name=None,
                                  initializer="zeros"):
    if name in _UNSHARDED_SLOTS:
      return original_from_reference(reference_variable, name, initializer)
    slot = _on_read_variable(
        optimizer, (_slice_size(reference_variable, replicas),), initializer,
        reference_variable.dtype,
        f"{reference_variable.path.replace('/', '_')}_{name or 'var'}")
    state["slots"][id(slot)] = reference_variable
    return slot

  def build(variables):
    if optimizer.built:
      return
    with strategy.scope():
      original_build(variables)
      for variable in variables:
        proxy = _on_read_variable(
            optimizer, (_slice_size(variable, replicas),), "zeros",
            variable.dtype, f"{variable.path.replace('/', '_')}_zero_slice")
        optimizer._trainable_variables_indices[optimizer._var_key(proxy)] = (  # pylint: disable=protected-access
            optimizer._get_variable_index(variable))  # pylint: disable=protected-access
        state["proxies"][id(variable.value)] = (proxy, variable)

  def clip_gradients(grads):
    return grads  # Clipped after the all-reduce, as one device does.

  original_clip = type(optimizer)._clip_gradients  # pylint: disable=protected-access

  # TFOptimizer._backend_update_step (which subclasses such as Nadam extend)
  # all-reduces, then updates every variable. The sharded update happens in
  # place of the all-reduce; nothing is left for the full update.
  def all_reduce_and_update(grads_and_vars):
    context = tf.distribute.get_replica_context()
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                 [g for g, _ in pairs])
    reduced = original_clip(optimizer, reduced)
    replica = context.replica_id_in_sync_group
    learning_rate = optimizer.learning_rate
    updated = []
    for grad, (_, tf_variable) in zip(reduced, pairs):
      proxy, variable = state["proxies"][id(tf_variable)]
      size = proxy.shape[0]
      start = replica * size
      proxy.assign(_slice(variable.value, start, size, replicas))
      optimizer.update_step(_slice(grad, start, size, replicas), proxy,
                            learning_rate)
      whole = context.all_gather(tf.convert_to_tensor(proxy.value), 0)
      updated.append(tf.reshape(
          whole[:int(np.prod(variable.shape))], variable.shape))

    def assign_all(distribution, values):
      for (_, tf_variable), value in zip(pairs, values):
        distribution.extended.update(
            tf_variable, lambda v, x: v.assign(x), args=(value,),
            group=False)
    context.merge_call(assign_all, args=(updated,))
    return []

  def logical_entries():
    """(variable, reference or None) in the order an unsharded optimizer
    has its variables; slices are left out of it."""
    proxies = {id(p) for p, _ in state["proxies"].values()}
    return [(v, state["slots"].get(id(v))) for v in optimizer.variables
            if id(v) not in proxies]

  def save_own_variables(store):
    for index, (variable, reference) in enumerate(logical_entries()):
      if reference is None:
        store[str(index)] = np.asarray(variable.numpy())
      else:
        store[str(index)] = _whole(variable, reference)

  def load_own_variables(store):
    entries = logical_entries()
    if len(store.keys()) != len(entries):
      raise ValueError(
          f"Optimizer {optimizer.name!r} has {len(entries)} logical "
          f"variables but the checkpoint lists {len(store.keys())}.")
    for index, (variable, reference) in enumerate(entries):
      if reference is None:
        variable.assign(store[str(index)])
      else:
        _assign_whole(variable, np.asarray(store[str(index)]), replicas)

  object.__setattr__(optimizer, "save_own_variables", save_own_variables)
  object.__setattr__(optimizer, "load_own_variables", load_own_variables)
  object.__setattr__(optimizer, "add_variable_from_reference",
                     add_variable_from_reference)
  object.__setattr__(optimizer, "build", build)
  object.__setattr__(optimizer, "_clip_gradients", clip_gradients)
  object.__setattr__(optimizer, "_all_reduce_sum_gradients",
                     all_reduce_and_update)


def _slice(value, start, size, replicas):
  """Elements [start, start + size) of `value` flattened and zero-padded
  to `size * replicas`."""
  flat = tf.reshape(tf.convert_to_tensor(value), [-1])
  flat = tf.pad(flat, [[0, size * replicas - flat.shape[0]]])
  return tf.slice(flat, [start], [size])


def _components(variable):
  value = variable.value
  return getattr(value, "values", (value,))


def _whole(slot, reference):
  """The full-shape value of a sliced slot (this host's replicas)."""
  flat = np.concatenate([np.asarray(c.read_value()) for c in
                         _components(slot)])
  size = int(np.prod(reference.shape))
  if flat.shape[0] < size:
    raise ValueError(
        "tfpar.ZeRO checkpoints need every replica on this host; "
        "saving from a multi-worker job is not supported yet.")
  return flat[:size].reshape(reference.shape)


def _assign_whole(slot, value, replicas):
  size = _components(slot)[0].shape[0]
  flat = np.pad(value.reshape(-1), (0, size * replicas - value.size))
  for index, component in enumerate(_components(slot)):
    component.assign(flat[index * size:(index + 1) * size])
