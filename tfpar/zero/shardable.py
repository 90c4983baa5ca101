"""Which optimizers `tfpar.ZeRO` can shard, checked before it does, and
where its collectives cannot run."""

from tfpar._compat import keras_optimizers

# Optimizers whose state is not elementwise in the weights.
_REFUSED = ("Adafactor",)


def check_shardable(optimizer, strategy):
  """Raises a ValueError for an optimizer ZeRO cannot shard."""
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
  created_under = keras_optimizers.distribution_strategy(optimizer, strategy)
  if created_under is not strategy:
    raise ValueError(
        f"Optimizer {optimizer.name!r} was created outside the model's "
        f"strategy scope ({strategy!r}); create it (and compile the model) "
        f"inside strategy.scope() for tfpar.ZeRO to shard it.")
  if optimizer.use_ema:
    raise ValueError(
        f"tfpar.ZeRO does not shard optimizers with use_ema=True (the "
        f"moving averages are full-size copies of the weights). Received "
        f"optimizer {optimizer.name!r} with use_ema=True.")


def refuse_eager_replicas(stage, doing):
  """Raises the `ValueError` for a ZeRO collective launched from an eager
  replica function: TensorFlow runs eager replicas one after another, so
  the first would wait forever for the others.

  Args:
    stage: the ZeRO stage.
    doing: what launched it ("gathers weight 'dense/kernel'").
  """
  raise ValueError(
      f"tfpar.ZeRO(stage={stage}) {doing} with collectives every replica "
      f"launches together, which replica functions run eagerly cannot. Run "
      f"the training step in a tf.function (`@tf.function` around the "
      f"function that calls strategy.run), or compile with "
      f"run_eagerly=False.")
