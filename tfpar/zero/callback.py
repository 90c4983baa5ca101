"""`tfpar.ZeRO`: the Keras callback that turns ZeRO on for a fit."""

import os

import keras

from tfpar import keras_hooks
from tfpar.engine import extended as engine_extended
from tfpar.engine import materialize
from tfpar.zero import checkpoint
from tfpar.zero import collectives
from tfpar.zero import regather
from tfpar.zero import shardable
from tfpar.zero import sharded_optimizer
from tfpar.zero import sharded_weights

_STAGES = (1, 2, 3)
_OFFLOADS = (None, "cpu")


class ZeRO(keras.callbacks.Callback):
  """Shards optimizer state, gradients and weights over the replicas.

  With N data-parallel replicas each device keeps 1/N of what plain data
  parallelism keeps on every device, and training gives the results of one
  device:

  * stage 1: the optimizer state (Adam's two moments and the slice of each
    weight it updates);
  * stage 2: also the gradients: they are reduce-scattered, and
    `gradient_accumulation_steps` accumulates 1/N slices;
  * stage 3: also the weights, all-gathered where a layer uses them.

  The state is sharded from the start: no full-size optimizer slot is ever
  allocated. Works under `tf.distribute.MirroredStrategy`,
  `MultiWorkerMirroredStrategy` and `tfpar.DataParallelStrategy`, with
  every Keras optimizer whose state is elementwise (SGD, Adam, AdamW,
  RMSprop, Adagrad, Nadam, Adamax, Lion, ...), gradient clipping, weight
  decay and gradient accumulation. Checkpoints hold whole tensors, so they
  resume on any number of replicas, with or without ZeRO.

  Args:
    stage: 1, 2 or 3.
    offload: None, or "cpu" to keep the optimizer state, and run its
      update, on the host CPU of each worker.
    bucket_bytes: the most bytes of gradients (or of updated weight
      slices) that one collective of the update step carries; the update
      sends its tensors in as few collectives as this allows (DeepSpeed's
      `reduce_bucket_size`). Under stage 3 also the most bytes of weights
      one all-gather of the forward or backward pass gathers, and one
      reduce-scatter of their gradients carries: the model is cut into
      units of whole layers that fit (FSDP's wrapped modules; the whole
      model when it fits), each gathering its weights in one all-gather
      per bucket (see `tfpar.zero.buckets`). Larger buckets mean fewer,
      larger messages and a larger temporary copy (under stage 3, more
      weights whole at once).
    load_from: None, or the path of a `.weights.h5` or `.keras` file to
      load weights and optimizer state from (written with or without ZeRO,
      on any number of replicas), once the optimizer is sharded at the
      start of the first `fit`. A plain `load_weights` before `fit` cannot
      do this: the optimizer is not built then, so Keras skips its state.
      A `BackupAndRestore` backup, when there is one, is loaded after it.

  Raises:
    ValueError: an unknown stage or offload, a bucket size that is not a
      positive integer, or a `load_from` file that does not exist or is not
      a `.weights.h5` / `.keras` file.

  Example:

  >>> import keras, numpy as np, tfpar
  >>> strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": -1}))
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  ...   model.compile(optimizer="adam", loss="mse")
  >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0,
  ...                     callbacks=[tfpar.ZeRO(stage=2)])
  """

  def __init__(self, stage=1, offload=None,
               bucket_bytes=collectives.DEFAULT_BUCKET_BYTES,
               load_from=None):
    super().__init__()
    if stage not in _STAGES:
      raise ValueError(
          f"tfpar.ZeRO: stage must be one of {_STAGES}. Received: "
          f"stage={stage!r}.")
    if offload not in _OFFLOADS:
      raise ValueError(
          f"tfpar.ZeRO: offload must be None or 'cpu'. Received: "
          f"offload={offload!r}.")
    if (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
        or bucket_bytes <= 0):
      raise ValueError(
          f"tfpar.ZeRO: bucket_bytes must be a positive integer (bytes). "
          f"Received: bucket_bytes={bucket_bytes!r}.")
    if load_from is not None:
      load_from = os.fspath(load_from)
      if not load_from.endswith((".weights.h5", ".keras")):
        raise ValueError(
            f"tfpar.ZeRO: load_from must be a '.weights.h5' or '.keras' "
            f"file. Received: load_from={load_from!r}.")
      if not os.path.isfile(load_from):
        raise ValueError(
            f"tfpar.ZeRO: load_from must name an existing file. Received: "
            f"load_from={load_from!r}, which does not exist.")
    self.stage = stage
    self.offload = offload
    self.bucket_bytes = bucket_bytes
    self.load_from = load_from
    keras_hooks.install_fit_preparation()

  def prepare_fit(self, model):
    """Shards `model.optimizer` (and under stage 3 the weights) before
    `fit` builds the optimizer (called by tfpar's `fit` hook)."""
    if model.run_eagerly:
      raise ValueError(
          "tfpar.ZeRO needs compiled steps (its collectives cannot be "
          "launched from eager replica functions one after another). "
          "Received: run_eagerly=True; compile with run_eagerly=False.")
    self.prepare_optimizer(model, model.optimizer)

  def prepare_optimizer(self, model, optimizer):
    """Shards `optimizer`, not built yet, for `model`'s trainable weights
    (and under stage 3 the weights): `model`'s compiled optimizer before
    `fit` builds it, or the optimizer a custom training loop builds
    (`DataParallelStrategy.extended.adopt_optimizer`).

    Args:
      model: a model created in the strategy's scope.
      optimizer: the Keras optimizer that trains it.
    """
    existing = getattr(optimizer, "_tfpar_zero", None)
    if existing is not None:
      if (existing.stage, existing.offload) != (self.stage, self.offload):
        raise ValueError(
            f"The optimizer of {model.name!r} is sharded with "
            f"tfpar.ZeRO(stage={existing.stage}, offload="
            f"{existing.offload!r}); it cannot change to stage="
            f"{self.stage}, offload={self.offload!r}.")
      return
    strategy = model.distribute_strategy
    _check_float32_weights(model)
    # A LossScaleOptimizer (mixed_float16) keeps its scale whole; the
    # optimizer it wraps is sharded.
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    shardable.check_shardable(inner, strategy)
    state = getattr(model, "_tfpar_zero_weights", None)
    if state is not None:  # Sliced when built (`prepare_weights`).
      if self.stage != 3:
        raise ValueError(
            f"The weights of {model.name!r} were sliced over the replicas "
            f"when it was built (its strategy has zero=tfpar.ZeRO(stage=3)); "
            f"fit cannot use tfpar.ZeRO(stage={self.stage}). Pass "
            f"tfpar.ZeRO(stage=3) or no ZeRO callback.")
      if state.bucket_bytes != self.bucket_bytes or any(
          not isinstance(weight, sharded_weights.GatheredWeight)
          for weight in model.trainable_variables):
        # Planned at build; weights frozen then are trainable now (a
        # backbone unfrozen for fine-tuning): sliced now.
        sharded_weights.shard(model, state)
        regather.regather_in_backward(model, self.bucket_bytes, strategy)
      state.offload, state.bucket_bytes = self.offload, self.bucket_bytes
    else:
      state = sharded_optimizer.ZeroState(self.stage, self.offload, strategy,
                                          self.bucket_bytes)
    if self.stage == 3 and state is not getattr(
        model, "_tfpar_zero_weights", None):
      sharded_weights.shard(model, state)
      regather.regather_in_backward(model, self.bucket_bytes, strategy)
    sharded_optimizer.shard(inner, state)
    object.__setattr__(optimizer, "_tfpar_zero", state)
    for saved in {id(o): o for o in (optimizer, inner)}.values():
      checkpoint.install(saved, model)  # Keras saves both.
    if self.load_from is not None:
      self._load(model)

  def prepare_loop_optimizer(self, model, optimizer, strategy):
    """Shards `optimizer`, which a custom training loop builds to train
    `model` (strategies created with `zero=` call it before it builds).

    Args:
      model: the model it trains (None: variables of no model created in
        the strategy's scope).
      optimizer: the Keras optimizer, not built yet.
      strategy: the model's strategy.

    Raises:
      ValueError: no model, a `load_from` (it loads a compiled model's
        state), or the build happens inside `strategy.run` (too late to
        create the sharded state: build it before the loop).
    """
    what = (f"{type(strategy).__name__}(zero=tfpar.ZeRO("
            f"stage={self.stage}))")
    if model is None:
      raise ValueError(
          f"{what} shards the optimizer of a model created in its scope; "
          f"optimizer {optimizer.name!r} is being built for variables of "
          f"no such model. Create the model in strategy.scope().")
    if self.load_from is not None:
      raise ValueError(
          f"tfpar.ZeRO(load_from={self.load_from!r}) loads the state of "
          f"the optimizer model {model.name!r} is compiled with; optimizer "
          f"{optimizer.name!r} belongs to a custom training loop. Compile "
          f"the model with it and train with fit.")
    if engine_extended.in_replica():
      raise ValueError(
          f"{what} creates the sharded state of optimizer "
          f"{optimizer.name!r} before its first step, and it is being built "
          f"inside strategy.run (by its first apply or apply_gradients). "
          f"Build it before the training loop: `with strategy.scope(): "
          f"optimizer.build(model.trainable_variables)`.")
    with strategy.scope():
      self.prepare_optimizer(model, optimizer)

  def prepare_weights(self, model, strategy):
    """Stage 3 at build time: gives a built model's trainable weights
    their ZeRO-3 slices as soon as it is built (a strategy created with
    `zero=tfpar.ZeRO(stage=3)` calls this when it prepares the model); the
    optimizer is sharded later, by `prepare_fit`.

    Args:
      model: a built Keras model created in `strategy.scope()`.
      strategy: the model's strategy.
    """
    if self.stage != 3 or getattr(model, "_tfpar_zero_weights", None):
      return
    owner = sharded_weights.sliced_with(model)
    if owner is not None:  # Prepared with a model holding it: planned.
      object.__setattr__(model, "_tfpar_zero_weights", owner)
      return
    _check_float32_weights(model)
    state = sharded_optimizer.ZeroState(self.stage, self.offload, strategy,
                                        self.bucket_bytes)
    sharded_weights.shard(model, state)
    regather.regather_in_backward(model, self.bucket_bytes, strategy)
    # Frozen weights (`layer.trainable = False` after building) stay whole
    # on every replica until a later compile makes them trainable.
    materialize.materialize_pending(model, strategy)
    object.__setattr__(model, "_tfpar_zero_weights", state)

  def _load(self, model):
    if not model.built:
      raise ValueError(
          f"tfpar.ZeRO(load_from={self.load_from!r}) needs model "
          f"{model.name!r} built before fit, to load its weights and "
          f"optimizer state; build it (keras.Input, or model.build).")
    with model.distribute_strategy.scope():
      model.optimizer.build(model.trainable_variables)  # Sharded state.
    model.load_weights(self.load_from)

  def set_model(self, model):
    super().set_model(model)
    if getattr(model.optimizer, "_tfpar_zero", None) is None:
      raise ValueError(
          "tfpar.ZeRO did not get to shard the optimizer before fit built "
          "it (fit was looked up before tfpar installed its hook). Import "
          "tfpar after keras, or create the strategy or the ZeRO callback "
          "before calling fit.")


def _check_float32_weights(model):
  """ZeRO keeps float32 master slices; half-precision variables (a
  "float16" or "bfloat16" policy, not a mixed one) are refused."""
  for variable in model.trainable_variables:
    if variable.dtype != "float32":
      raise ValueError(
          f"tfpar.ZeRO shards float32 weights (Keras's mixed policies keep "
          f"them float32); weight {variable.path!r} is {variable.dtype}, "
          f"whose update ZeRO cannot make exact. Use the 'mixed_float16' or "
          f"'mixed_bfloat16' policy, or no ZeRO. Received: "
          f"{variable.path}.dtype={variable.dtype}")


keras_hooks.install_fit_preparation()
