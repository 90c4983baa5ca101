"""Models created in a strategy's scope, prepared once built.

tfpar's Keras hook registers every model created in a strategy's scope;
the strategy prepares each (shards it, cuts it into pipeline stages) once
it is built and before it first runs. Keras enters the scope again before
its symbolic build (which builds the optimizer), distributes data, then
runs steps: each of these prepares pending models, and a model built while
a step ran (too late to prepare) is an error, not a silently unprepared
model.
"""

import threading
import weakref

import tensorflow as tf

from tfpar._compat import keras_layers


class PreparedModels:
  """Mixin of `MeshExtended`: the registry of models created in scope and
  their preparation. Subclasses override `prepare_model`, `is_prepared`
  and `preparation`."""

  def _init_prepared_models(self):
    self._models = []  # weakrefs of models created in scope.
    self._preparing = threading.local()

  def register_model(self, model):
    """Called by tfpar's Keras hook for every model created in scope (a
    Functional model's trainer is initialised twice: registered once)."""
    if not any(ref() is model for ref in self._models):
      self._models.append(weakref.ref(model))

  def registered_models(self):
    """The live models created in this strategy's scope."""
    models = [ref() for ref in self._models]
    self._models = [weakref.ref(m) for m in models if m is not None]
    return [m for m in models if m is not None]

  def prepare_pending_models(self):
    """Prepares every registered model (see `prepare_model`). Unless
    `prepares_outermost_first()` says no, a model that holds others (a
    keras-hub task model and its backbone, a backbone and its vision
    encoder) goes before them: its plan then sees every layer, the head
    that reads a pooler included, and its inner models are prepared as
    part of it."""
    if getattr(self._preparing, "active", False):
      return
    self._preparing.active = True
    try:
      with tf.init_scope():
        models = self.registered_models()
        if self.prepares_outermost_first():
          models = outermost_first(models)
        for model in models:
          self.prepare_model(model)
    finally:
      self._preparing.active = False

  def model_of(self, variables):
    """(model, its weights for `variables`): the model created in this
    strategy's scope whose trainable weights include every one of
    `variables` (the outermost if several do), with those weights in the
    order of `variables`; or (None, `variables`). A weight its model's
    preparation replaced is found by its path (tensor parallelism splits a
    layer's kernel into a new variable of the same path; expert
    parallelism's `<path>_experts` is a shard of the whole weight
    `<path>`)."""
    variables = list(variables)
    models = sorted(self.registered_models(),
                    key=lambda m: -len(m.trainable_variables))
    for keys in (lambda v: (id(v),), _paths):
      for model in models:
        weights = {key: v for v in model.trainable_variables
                   for key in keys(v)}
        found = [next((weights[k] for k in keys(v) if k in weights), None)
                 for v in variables]
        if all(weight is not None for weight in found):
          return model, found
    return None, variables

  def prepares_outermost_first(self):
    """Whether a model holding registered models is prepared before them
    (else in creation order: nested models first)."""
    return True

  def prepare_model(self, model):
    """Subclasses adapt a registered model here (it may be unbuilt or
    prepared already)."""
    del model

  def check_run(self, model):
    """Refuses, before any work, a model marked built whose layers are not
    all built when the strategy lays weights out as they are created
    (`spreads_weights`): it is laid out before Keras builds those layers,
    which then create their weights inside the traced step (they failed
    inside tfpar). Keras's `Model.build(input_shape)` marks a subclassed
    model built without building its layers. An unbuilt model is left to
    Keras's build before the first step unless `refuses_unbuilt_models`."""
    if not self.spreads_weights:  # MeshExtended's, set by strategies.
      return
    unbuilt = [layer.name for layer in keras_layers.flatten_layers(
        model, include_self=False) if not layer.built]
    if unbuilt and (model.built or self.refuses_unbuilt_models):
      raise ValueError(
          f"Model {model.name!r} ({type(model).__name__}) has layers that "
          f"are not built: {unbuilt[:5]}{' ...' if len(unbuilt) > 5 else ''}"
          f". They would create their weights while the step is traced, "
          f"after {type(self._container_strategy()).__name__} laid out the "
          f"model's weights. Call the model on a batch inside "
          f"strategy.scope() before compile and fit (model(x[:1])), or "
          f"build it from a keras.Input; Keras's Model.build(input_shape) "
          f"does not build a subclassed model's layers. A layer the model "
          f"never calls stays unbuilt: remove it.")

  # Whether a model Keras builds only before its first step (no
  # keras.Input) is refused: it is when the strategy must lay weights out
  # before the optimizer is built (ZeRO-3).
  refuses_unbuilt_models = False

  # What `prepare_model` does, for the error of a model that ran unprepared.
  preparation = "prepare it"

  def is_prepared(self, model):
    """Whether `prepare_model` has adapted a built model."""
    del model
    return True

  def check_models_prepared(self):
    """Raises if a model of this strategy got built while it ran, after it
    could be prepared (it would silently run unprepared)."""
    for model in self.registered_models():
      if model.built and not self.is_prepared(model):
        raise ValueError(
            f"Model {model.name!r} was built while it ran, after tfpar could "
            f"{self.preparation}. Build it inside strategy.scope() before "
            f"compile/fit: give it a keras.Input, or call "
            f"model.build(input_shape) or model(x).")


def holds(outer, model):
  """Whether `model` runs inside `outer`: a layer nested in it at any depth
  (a keras-hub task model's backbone) or the Functional graph Keras made
  for it (a Sequential's, which Keras creates in scope too).

  Args:
    outer: a Keras model.
    model: a Keras model.

  Returns:
    A bool; False when they are the same model.

  Example:

  >>> import keras
  >>> inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
  >>> outer = keras.Sequential([keras.Input((2,)), inner])
  >>> holds(outer, inner), holds(inner, outer), holds(outer, outer)
  (True, False, False)
  """
  if outer is model:
    return False
  return keras_layers.functional_graph(outer) is model or any(
      layer is model
      for layer in keras_layers.flatten_layers(outer, include_self=False))


def outermost_first(models):
  """`models` ordered so that each comes before the models it `holds`;
  otherwise in their given order.

  Args:
    models: Keras models.

  Returns:
    A list of the same models.

  Example:

  >>> import keras
  >>> inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
  >>> outer = keras.Sequential([keras.Input((2,)), inner])
  >>> [m is outer for m in outermost_first([inner, outer])]
  [True, False]
  """
  models = list(models)
  holders = {id(model): sum(holds(outer, model) for outer in models)
             for model in models}
  return sorted(models, key=lambda model: holders[id(model)])


def _paths(variable):
  """`variable`'s path and, for a shard a preparation made of a whole
  weight, the whole weight's."""
  shard_of = getattr(variable, "_tfpar_shard_of", None)
  paths = (getattr(variable, "path", None),
           getattr(shard_of[0], "path", None) if shard_of else None)
  return tuple(path for path in paths if path is not None)
