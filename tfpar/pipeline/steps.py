"""Pipelined `train_step`, `test_step` and `predict_step` for Keras models.

They replace a cut model's steps and keep Keras's meaning exactly:

* A replica's batch of n rows is split into m micro-batches of n_k rows
  (equal when m divides n; a final partial batch splits unevenly).
* Micro-batch k's loss terms (compiled loss, and each stage's
  `layer.losses`: weight regularizers and activity regularizers) are
  weighted by n_k / n. Keras's per-sample reductions
  (`"sum_over_batch_size"`, `"mean"`) and its activity regularizers divide
  by the batch size, so the weighted sum equals the whole batch's loss,
  and its gradient equals the whole batch's gradient.
* Metrics see the whole batch: the micro-batch predictions are
  concatenated and passed to `compute_metrics` once.
"""

import keras
import tensorflow as tf

from tfpar._compat import keras_trainer
from tfpar._compat.keras_modules import loss_module
from tfpar._compat.keras_modules import unpack_x_y_sample_weight as _unpack
_PER_SAMPLE_REDUCTIONS = ("sum_over_batch_size", "mean")


def _first_tensor(x):
  return next(t for t in tf.nest.flatten(x) if t is not None)


def split(structure, sizes, num):
  """Splits every tensor of `structure` into `num` parts of rows `sizes`."""
  if structure is None:
    return [None] * num
  leaves = [None if t is None else tf.split(t, sizes, num=num, axis=0)
            for t in tf.nest.flatten(structure)]
  return [tf.nest.pack_sequence_as(
      structure, [None if l is None else l[k] for l in leaves])
          for k in range(num)]


def microbatch_sizes(batch_size, num_microbatches):
  """Rows per micro-batch: as equal as possible, larger ones first."""
  base = batch_size // num_microbatches
  extra = batch_size % num_microbatches
  return tf.where(tf.range(num_microbatches) < extra, base + 1, base)


def concat(outputs):
  """Joins the per-micro-batch outputs back into one batch."""
  return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0),
                               *outputs)


def check_model(model):
  """Raises if a model customizes the steps the pipeline replaces."""
  for name in ("train_step", "test_step", "predict_step"):
    if getattr(type(model), name) is not getattr(
        keras_trainer.TensorFlowTrainer, name):
      raise ValueError(
          f"Model {model.name!r} overrides {name}(); PipelineParallelStrategy "
          f"replaces Keras's own steps with pipelined ones and cannot "
          f"pipeline custom step code. Use a stock Keras model.")
  if type(model).compute_loss is not keras.Model.compute_loss:
    raise ValueError(
        f"Model {model.name!r} overrides compute_loss(); the pipeline "
        f"computes the loss per micro-batch on the last stage from the "
        f"compiled loss and the layers' losses.")


def check_losses(model):
  """Raises unless every compiled loss averages over the batch."""
  for loss in tf.nest.flatten(getattr(model, "loss", None)):
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction not in _PER_SAMPLE_REDUCTIONS:
      raise ValueError(
          f"Loss {getattr(loss, 'name', loss)!r} has reduction="
          f"{reduction!r}; pipeline micro-batches need a per-sample average "
          f"(one of {_PER_SAMPLE_REDUCTIONS}) so their losses add up to the "
          f"batch's.")


class PipelinedSteps:
  """The pipelined steps of one model.

  Args:
    model: the cut Keras model.
    runner_for_replica: a function returning the `StageRunner` of the
      replica running now.
    num_microbatches: m.
  """

  def __init__(self, model, runner_for_replica, num_microbatches):
    self._model = model
    self._runner = runner_for_replica
    self._m = num_microbatches

  def _sizes(self, x):
    """The batch's rows and the rows of each micro-batch."""
    n = tf.shape(_first_tensor(x))[0]
    return n, microbatch_sizes(n, self._m)

  def _split(self, data):
    check_losses(self._model)
    x, y, sample_weight = _unpack(data)
    n, sizes = self._sizes(x)
    weights = tf.cast(sizes, keras.backend.floatx()) / tf.cast(
        tf.maximum(n, 1), keras.backend.floatx())
    return (x, y, sample_weight, n, weights,
            split(x, sizes, self._m), split(y, sizes, self._m),
            split(sample_weight, sizes, self._m))

  def _loss_fn(self, ys, sample_weights, weights, scale):
    model = self._model

    def loss_fn(k, y_pred):
      compiled = keras_trainer.compiled_loss(model)
      if compiled is None:
        return tf.zeros(())
      loss = compiled(ys[k], y_pred, sample_weights[k])
      return tf.cast(loss, weights.dtype) * weights[k] * scale
    return loss_fn

  def _extra_loss_fn(self, weights, scale):
    model = self._model

    def extra_loss_fn(k, stage_model):
      terms = [keras_trainer.scaled_layer_loss(model, l)
               for l in stage_model.losses]
      if not terms:
        return tf.zeros((), weights.dtype)
      return tf.add_n(terms) * weights[k] * scale
    return extra_loss_fn

  def _track_loss(self, loss, n):
    keras_trainer.loss_tracker(self._model).update_state(
        loss_module.unscale_loss_for_distribution(loss), sample_weight=n)

  def train_step(self, data):
    """One pipelined training step (replaces `model.train_step`)."""
    model = self._model
    x, y, sample_weight, n, weights, xs, ys, sws = self._split(data)
    # What Keras's own train_step multiplies the loss by: a
    # LossScaleOptimizer's current dynamic scale, a base optimizer's
    # constant `loss_scale_factor`, or 1. The optimizer unscales the
    # gradients (and skips a step whose gradients overflowed).
    scale = tf.cast(model.optimizer.scale_loss(tf.constant(1.0))
                    if model.optimizer else 1.0, keras.backend.floatx())
    outputs, loss, gradients = self._runner().train(
        xs, self._loss_fn(ys, sws, weights, scale),
        self._extra_loss_fn(weights, scale))
    loss = loss / scale
    self._track_loss(loss, n)
    trainable = model.trainable_weights
    missing = [v.path for v in trainable if id(v) not in gradients]
    if missing:
      raise ValueError(f"Variables outside every pipeline stage: {missing}")
    model.optimizer.apply_gradients(
        [(gradients[id(v)], v) for v in trainable])
    return model.compute_metrics(x, y, concat(outputs),
                                 sample_weight=sample_weight)

  def test_step(self, data):
    """One pipelined evaluation step (replaces `model.test_step`)."""
    model = self._model
    x, y, sample_weight, n, weights, xs, ys, sws = self._split(data)
    outputs, extra = self._runner().predict(
        xs, training=False, extra_loss_fn=self._extra_loss_fn(weights, 1.0))
    loss_fn = self._loss_fn(ys, sws, weights, 1.0)
    loss = tf.add_n([extra] + [loss_fn(k, out)
                               for k, out in enumerate(outputs)])
    self._track_loss(loss, n)
    return model.compute_metrics(x, y, concat(outputs),
                                 sample_weight=sample_weight)

  def predict_step(self, data):
    """One pipelined prediction step (replaces `model.predict_step`)."""
    x, _, _ = _unpack(data)
    xs = split(x, self._sizes(x)[1], self._m)
    return concat(self._runner().predict(xs, training=False)[0])
