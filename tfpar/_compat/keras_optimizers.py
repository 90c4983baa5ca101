"""Private state and update hooks of Keras optimizers.

ZeRO keeps each optimizer slot as a slice per replica and runs its own
update step; tensor and expert parallelism all-reduce, clip and save
gradients and slots per shard or expert group. Keras exposes none of this
publicly: the per-variable slot index, the gradient accumulators, the
all-reduce and clipping steps and the backend update step are private.
Every accessor checks what it relies on (`Incompatible` otherwise).
"""

import keras
import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat.checks import require
from tfpar._compat.keras_modules import tf_optimizer

for _name in ("_var_key", "_get_variable_index", "_track_variable",
              "_use_weight_decay", "_backend_update_step"):
  require(keras.optimizers.Optimizer, _name, "sharded optimizer state")
for _name in ("_all_reduce_sum_gradients", "_backend_apply_gradients",
              "_clip_gradients"):
  require(tf_optimizer.TFOptimizer, _name, "sharded gradient reduction")


def distribution_strategy(optimizer, default=None):
  """The strategy an optimizer was created under, or `default`."""
  return getattr(optimizer, "_distribution_strategy", default)


def track_variable(optimizer, variable):
  """Makes `optimizer` own `variable` (saved and listed with its state)."""
  optimizer._track_variable(variable)  # pylint: disable=protected-access


def variable_index(optimizer, variable):
  """The index of `variable`'s slots in the optimizer's slot lists."""
  return optimizer._get_variable_index(variable)  # pylint: disable=protected-access


def share_variable_index(optimizer, alias, variable):
  """Makes `alias` (a slice standing for `variable` in the update) find
  `variable`'s slots."""
  indices = require(optimizer, "_trainable_variables_indices",
                    "slot lookup")
  indices[optimizer._var_key(alias)] = variable_index(optimizer, variable)  # pylint: disable=protected-access


def accumulated_gradients(optimizer):
  """The optimizer's gradient accumulators (gradient_accumulation_steps),
  in slot order."""
  return require(optimizer, "_accumulated_gradients",
                 "gradient accumulation")


def iterations_variable(optimizer):
  """The optimizer's step counter variable (counting accumulation steps)."""
  return require(optimizer, "_iterations", "the step counter")


def uses_weight_decay(optimizer, variable):
  """Whether the optimizer decays `variable` (its exclusion lists)."""
  return optimizer._use_weight_decay(variable)  # pylint: disable=protected-access


def all_reduce_sum_gradients(optimizer):
  """The optimizer's bound step that sums gradients over replicas."""
  return optimizer._all_reduce_sum_gradients  # pylint: disable=protected-access


def replace_all_reduce_sum_gradients(optimizer, function):
  """Makes `optimizer` sum its gradients over replicas with
  `function(grads_and_vars)` (clipping, if any, stays after it)."""
  object.__setattr__(optimizer, "_all_reduce_sum_gradients", function)


def clip_after_all_reduce(optimizer, all_reduce_then_clip):
  """Makes `optimizer` skip Keras's clipping before the all-reduce and run
  `all_reduce_then_clip(grads_and_vars)` instead (clipping norms summed
  over shards)."""
  object.__setattr__(optimizer, "_clip_gradients", lambda grads: grads)
  replace_all_reduce_sum_gradients(optimizer, all_reduce_then_clip)


def replace_apply_gradients(optimizer, function):
  """Makes `optimizer` apply gradients with
  `function(grads, trainable_variables)` inside Keras's apply step (after
  loss scaling and before the iteration count)."""
  object.__setattr__(optimizer, "_backend_apply_gradients", function)


def update_step(optimizer, grads, trainable_variables, learning_rate):
  """Keras's update of every variable from its gradient (the class's
  own, or the one `with_update_step` installed)."""
  optimizer._backend_update_step(  # pylint: disable=protected-access
      grads, trainable_variables, learning_rate)


class _UpdateStep(keras.optimizers.Optimizer):
  """Comes right after the optimizer's own class in its method order, so
  that what the class adds before the update (Nadam's momentum-schedule
  product) still runs, and then `self._tfpar_update_step` replaces the
  merge_call based update of Keras's TensorFlow optimizer."""

  def _backend_update_step(self, grads, trainable_variables, learning_rate):
    self._tfpar_update_step(grads, trainable_variables)

  # A slice is a sync-on-read variable, which takes no scatter; an
  # `IndexedSlices` update (SGD's on an embedding's slice) goes to the
  # replica's own component, as one device scatters into its table. Only the
  # variable gets this; slot variables keep scattering (Adam squares each
  # repeated row on its own, as one device does).

  def assign_add(self, variable, value):
    super().assign_add(_scatter_target(variable, value), value)

  def assign_sub(self, variable, value):
    super().assign_sub(_scatter_target(variable, value), value)

  def assign(self, variable, value):
    super().assign(_scatter_target(variable, value), value)


def _scatter_target(variable, value):
  if isinstance(value, tf.IndexedSlices):
    inner = getattr(variable, "value", None)  # A Keras variable's tf one.
    if isinstance(inner, tf.distribute.DistributedValues):
      return distribute.local_component(inner)
  return variable


_classes = {}


def with_update_step(optimizer, update_step_function):
  """Makes `optimizer` run `update_step_function(grads, variables)` as its
  update step, keeping its class's own preparation (see `_UpdateStep`):
  its class becomes a subclass of its class with the same name."""
  cls = type(optimizer)
  if cls not in _classes:
    swapped = type(cls.__name__, (cls, _UpdateStep), {})
    swapped.__module__, swapped.__qualname__ = cls.__module__, cls.__qualname__
    _classes[cls] = swapped
  object.__setattr__(optimizer, "_tfpar_update_step", update_step_function)
  optimizer.__class__ = _classes[cls]
