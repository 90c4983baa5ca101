"""`StrategyHooks`: what tfpar's modules ask of a strategy's
`StrategyExtended`, declared once with what each means for a stock
TensorFlow strategy (which has none of them).

tfpar's `MeshExtended` inherits these defaults and overrides what its
strategies do differently; Keras's hooks, ZeRO, the watchdog and the
layout printer read them through `of(strategy)`, which gives the
defaults for a stock `MirroredStrategy` or `MultiWorkerMirroredStrategy`
(ZeRO and tfpar's callbacks also run under those).

Example:

>>> import tensorflow as tf
>>> hooks = of(tf.distribute.get_strategy())  # The default strategy.
>>> hooks.zero_traces_per_replica, hooks.timeouts
(1, None)
"""


class StrategyHooks:
  """The hooks and their stock-strategy defaults (see the module)."""

  # The `tfpar.Mesh` the strategy runs on, and the bounded waits of a
  # multi-worker job (`tfpar.timeouts`); None for stock strategies.
  mesh = None
  timeouts = None
  # Datasets distributed so far (`keras_hooks` learns from it whether a
  # run that raised left input iterators behind); None: not counted.
  datasets_distributed = None
  # Components of a variable per data replica: one per device of a tensor
  # group under per-device (SPMD) strategies.
  zero_traces_per_replica = 1
  # Whether ZeRO-3 may run a layer's call again in its backward pass.
  zero_recomputes = True
  # `symbolic_build_batch(batch)`: the batch Keras builds a model from
  # before its first run (`keras_hooks.install_symbolic_build_batch`);
  # None: Keras's own (a reduce of the batch across replicas).
  symbolic_build_batch = None
  # Whether `check_batch_size` checks anything (`keras_hooks` reads a
  # run's batch size only then).
  checks_batch_size = False

  def register_model(self, model):
    """Records `model`, created in the strategy's scope, to lay it out once
    built."""
    del model

  def adopt_optimizer(self, optimizer, variables):
    """Prepares `optimizer`, created in the strategy's scope, before it is
    first built for `variables` (tfpar's Keras hook calls it), as the
    strategy prepares a compiled model's optimizer: what a custom training
    loop (`strategy.run` with `optimizer.apply_gradients`) needs. Returns
    the weights to build it for (`variables`, or those that replaced them
    when the strategy prepared their model), or None: `variables`. A stock
    strategy is left to Keras."""
    del optimizer, variables
    return None

  def generate_function(self, model):
    """The function keras-hub's `CausalLM.generate` runs for `model`
    (`fn(inputs, stop_token_ids=None)`, `_compat/keras_hub_generate.py`),
    or None: keras-hub's own."""
    del model
    return None

  def check_run(self, model):
    """Raises for a setting of `model` the strategy cannot run (`fit`,
    `evaluate` and `predict` call it first)."""
    del model

  def steps_loop_refusal(self):
    """Why the strategy cannot run `fit`, `evaluate` or `predict` with
    `steps_per_execution > 1`, which Keras runs as steps inside a
    `tf.cond` in a `tf.while_loop` (`keras_hooks` refuses it before any
    work with this reason), or None where it runs. A stock strategy is
    left to Keras."""
    return None

  def check_batch_size(self, batch_size, what="batch_size"):
    """Raises unless the strategy can split `batch_size` (`what` names it
    in the message; with `checks_batch_size`)."""
    del batch_size, what

  def zero_trace(self, column=None):
    """(device column of ZeRO's group, local replica index) of the trace
    running now, or None: ZeRO's group is the replicas' (`column`: the
    first device column of the weight's devices)."""
    del column
    return None

  def zero_gather_columns(self, wholes):
    """`wholes` (vectors gathered over the data replicas) as `[columns,
    n]`: one column here."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return [tf.expand_dims(w, 0) for w in wholes]

  def zero_partial_gradients(self, grads, variables):
    """`grads` with partial ones (of weights whose gradient each device
    holds a part of) summed: none here."""
    del variables
    return grads

  def zero_sum_over_shards(self, squares, variables):
    """Per-weight sums of squared gradients, those of split weights
    summed over their shards: none here."""
    del variables
    return squares

  def describe_elsewhere(self, model):
    """{weight path: (style, shard shape, devices)} of weights another
    parallelism lays out, for `ShardingPlan.describe`: none here."""
    del model
    return {}

  def stage_plan(self, model):
    """How `model` is cut into pipeline stages, or None: not cut."""
    del model
    return None


_STOCK = StrategyHooks()


def of(strategy):
  """The `StrategyHooks` of `strategy`: its extended if tfpar's, else the
  stock defaults.

  Args:
    strategy: a `tf.distribute.Strategy` (or None: the defaults).
  """
  extended = getattr(strategy, "extended", None)
  return extended if isinstance(extended, StrategyHooks) else _STOCK
