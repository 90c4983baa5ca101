"""ZeRO stage 3's units: each layer's weights gathered in buckets, and
gathered again in the backward pass rather than kept alive until then."""

import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar._compat.keras_modules import keras_variables
from tfpar.common import instrument
from tfpar.common import recomputed_state
from tfpar.common import strategy_hooks
from tfpar.engine import extended as engine_extended
from tfpar.zero import buckets
from tfpar.zero import collectives
from tfpar.zero import sharded_weights


def _recomputed(call, unit):
  """`call`, run again in the backward pass (gathering the weights again)
  instead of keeping its gathered weights alive until then; each run
  gathers `unit`'s buckets (`buckets.gathered`); what the call assigns
  (batch normalization's moving statistics) it updates once, and the
  losses its layers add keep their gradients (`recomputed_state`)."""
  def wrapped(*args, **kwargs):
    if not engine_extended.in_replica():
      return call(*args, **kwargs)
    runs = []
    state = recomputed_state.CallState(unit.layer.non_trainable_variables)
    losses = recomputed_state.AddedLosses(unit.layer)
    # The backward pass runs `call` again after Keras left the layer's
    # autocast scope (mixed precision): enter the same scope again.
    autocast = keras_variables.get_autocast_scope()
    autocast_dtype = autocast.dtype if autocast is not None else None

    # `tf.recompute_grad` adds a float to each of its arguments: a mask
    # or token ids (bool, int) given by position is held, not passed.
    floating = [index for index, arg in enumerate(args) if _floating(arg)]

    def run(*inputs):
      runs.append(None)
      again = len(runs) > 1
      merged = list(args)
      for index, value in zip(floating, inputs):
        merged[index] = value
      with sharded_weights.phase(instrument.BACKWARD if again else
                                 sharded_weights.current_phase()), \
          keras_variables.AutocastScope(autocast_dtype), \
          buckets.running(unit), \
          (state.undone() if again else state.recorded()):
        return call(*merged, **kwargs)
    return losses.placed(tf.recompute_grad(losses.returning(run))(
        *[args[index] for index in floating]))
  return wrapped


def _floating(value):
  dtype = getattr(value, "dtype", None)
  return dtype is not None and tf.as_dtype(dtype).is_floating


def _is_gathered(weight):
  return isinstance(weight, sharded_weights.GatheredWeight)


def _kept(call, unit):
  """`call`, gathering `unit`'s buckets once and keeping them for the
  backward pass (a layer that draws random numbers)."""
  def wrapped(*args, **kwargs):
    if not engine_extended.in_replica():
      return call(*args, **kwargs)
    with buckets.running(unit):
      return call(*args, **kwargs)
  return wrapped


def regather_in_backward(model, bucket_bytes, strategy):
  """Cuts `model`'s ZeRO-3 weights into units and buckets of up to
  `bucket_bytes` (`buckets.plan`): each unit's call gathers a bucket with
  one all-gather, and its gradient is one reduce-scatter. A unit is
  recomputed in its backward pass, which gathers its weights again, so
  that gathered weights live only while used.

  Units with a layer that draws random numbers (dropout inside) are not
  recomputed (new masks would be drawn): they keep their gathered weights.
  Plain embedding lookups are left out: their backward pass needs the
  token ids, not the table, and `tf.recompute_grad` would densify their
  sparse gradients (which ZeRO applies as MirroredStrategy does,
  `sparse_gradients`); they gather their table alone.

  Args:
    model: a Keras model whose weights `shard` sliced.
    bucket_bytes: the most bytes of weights one collective carries.
    strategy: the strategy of `model` (its sites of fixed keys).
  """
  # A strategy may not recompute calls (SPMD sequence parallelism).
  recomputes = strategy_hooks.of(strategy).zero_recomputes
  for layer in keras_layers.flatten_layers(model):  # Planned before.
    original = getattr(layer, "_tfpar_zero_call", None)
    if original is not None:
      layer.call = original
  for weight in model.trainable_variables:
    if _is_gathered(weight):
      weight._tfpar_zero_bucket = None  # pylint: disable=protected-access
  units = buckets.plan(model, bucket_bytes, _is_gathered,
                       lambda w: getattr(w, "_tfpar_zero_column", None))
  for unit in units:
    for bucket in unit.buckets:
      bucket.site = collectives.new_site(strategy)
      for index, weight in enumerate(bucket.weights):
        weight._tfpar_zero_bucket = (unit, bucket, index)  # pylint: disable=protected-access
    layer = unit.layer
    object.__setattr__(layer, "_tfpar_zero_call", layer.call)
    wrap = _recomputed if unit.recomputed and recomputes else _kept
    layer.call = wrap(layer.call, unit)
  object.__setattr__(model, "_tfpar_zero_plan", (bucket_bytes, units))
