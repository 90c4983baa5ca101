"""The hooks tfpar adds to Keras's TensorFlow optimizers.

Keras applies `gradient_accumulation_steps` inside a `tf.cond` whose
branches reach the strategy through `merge_call`, which TF refuses inside
a cond (keras-team/keras#17429). Under a tfpar strategy it runs in the
strategy's no-`merge_call` mode instead (`tfpar.engine.merge_free`):

* Gradient accumulation: an optimizer with `gradient_accumulation_steps`
  applies its gradients inside `strategy.extended.without_merge_call()`;
  each accumulated gradient is all-reduced on its variable's device.
* Loss scaling: `LossScaleOptimizer`'s finiteness check counts the
  overflows of every replica, so that every replica skips the same steps.
  (Under stock strategies Keras takes the first replica's check, made on
  gradients not yet all-reduced: an overflow on another replica reaches
  the weights.)
* Adoption before build: an optimizer created in a strategy's scope calls
  a function of tfpar's before it is first built (by `optimizer.build`, or
  by its first `apply` / `apply_gradients`), so that a custom training
  loop's optimizer is prepared as a compiled model's is.

The patches are installed once per process and are idempotent; each checks
the Keras method it wraps and raises `ImportError` if it moved.
"""

import functools
import inspect

import tensorflow as tf

from tfpar._compat.keras_modules import loss_scale_optimizer
from tfpar._compat.keras_modules import tf_optimizer

_installed = set()


def _merge_free_scope():
  """The current strategy's `without_merge_call`, or None (not tfpar)."""
  return getattr(tf.distribute.get_strategy().extended, "without_merge_call",
                 None)


def _merge_free_active():
  extended = tf.distribute.get_strategy().extended
  return getattr(extended, "merge_free_active", lambda: False)()


def _check_wrappable(cls, names, needle=None):
  methods = [getattr(cls, name, None) for name in names]
  if any(m is None for m in methods) or (
      needle and needle not in inspect.getsource(methods[0])):
    import keras  # pylint: disable=g-import-not-at-top
    raise ImportError(
        f"tfpar needs Keras's {cls.__name__}.{', '.join(names)} (keras "
        f"{keras.__version__}): this Keras moved them, and tfpar's "
        f"strategies would fail inside its tf.cond.")
  return methods


def install_accumulation_without_merge_call():
  """Patches the TensorFlow optimizer to apply accumulated gradients in the
  strategy's no-`merge_call` mode, each gradient all-reduced on the device
  of its variable (a tensor shard's gradients where the shard lives)."""
  if "accumulation" in _installed:
    return
  cls = tf_optimizer.TFOptimizer
  apply, all_reduce = _check_wrappable(
      cls, ("_backend_apply_gradients", "_all_reduce_sum_gradients"),
      "gradient_accumulation_steps")

  @functools.wraps(apply)
  def _backend_apply_gradients(self, grads, trainable_variables):
    scope = _merge_free_scope()
    if not self.gradient_accumulation_steps or scope is None or (
        tf.distribute.in_cross_replica_context()):
      return apply(self, grads, trainable_variables)
    with scope():
      return apply(self, grads, trainable_variables)

  @functools.wraps(all_reduce)
  def _all_reduce_sum_gradients(self, grads_and_vars):
    grads_and_vars = list(grads_and_vars)
    if _merge_free_active():
      # The accumulated gradients were computed outside any device scope.
      placed = []
      for grad, var in grads_and_vars:
        if grad is not None and not isinstance(grad, tf.IndexedSlices):
          with tf.device(var.device):
            grad = tf.identity(grad)
        placed.append((grad, var))
      grads_and_vars = placed
    return all_reduce(self, grads_and_vars)

  cls._backend_apply_gradients = _backend_apply_gradients
  cls._all_reduce_sum_gradients = _all_reduce_sum_gradients
  _installed.add("accumulation")


def install_global_overflow_check():
  """Patches `LossScaleOptimizer.check_finite` to decide, under a tfpar
  strategy, from the gradients of every replica."""
  if "loss_scaling" in _installed:
    return
  cls = loss_scale_optimizer.LossScaleOptimizer
  (check_finite,) = _check_wrappable(cls, ("check_finite",))

  @functools.wraps(check_finite)
  def _check_finite(self, grads):
    finite = check_finite(self, grads)
    context = tf.distribute.get_replica_context()
    if _merge_free_scope() is None or context is None:  # Not tfpar's.
      return finite
    overflows = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite),
                                            tf.float32))
    return tf.equal(overflows, 0.0)

  cls.check_finite = _check_finite
  _installed.add("loss_scaling")


def install_before_first_build(before_build):
  """Patches Keras's TensorFlow optimizer so that every optimizer created
  from now on calls `before_build(optimizer, variables)` before it is first
  built, wherever the build comes from; it returns the variables to build
  for instead, or None (those given). `before_build` may replace the
  optimizer's `build` (ZeRO does): the build then goes to the new one,
  which may call the one it replaced (the class's build runs then). A
  build replaced before (ZeRO's under `fit`) calls this one, which then
  runs the class's build."""
  if "before_build" in _installed:
    return
  cls = tf_optimizer.TFOptimizer
  (init,) = _check_wrappable(cls, ("__init__",), "_distribution_strategy")

  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    init(self, *args, **kwargs)
    _wrap_build(self, before_build)

  cls.__init__ = __init__
  _installed.add("before_build")


def _wrap_build(optimizer, before_build):
  class_build = optimizer.build  # Bound to the optimizer's class.
  building = []  # Set while `before_build` and the build it leads to run.

  def build(variables):
    if optimizer.built or building:
      return class_build(variables)
    building.append(True)
    try:
      entry = optimizer.build  # This, or a build that calls it (ZeRO's).
      variables = before_build(optimizer, variables) or variables
      replaced = optimizer.build is not entry
      return (optimizer.build if replaced else class_build)(variables)
    finally:
      building.clear()

  object.__setattr__(optimizer, "build", build)
