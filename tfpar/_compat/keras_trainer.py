"""Private state of Keras's TensorFlow trainer (a compiled model).

The pipeline replaces a model's train/test steps with pipelined ones and
must compute the loss per micro-batch exactly as Keras's own step does:
the compiled loss, the scaling of layers' losses, the loss tracker that
`fit` logs. Models created in a strategy's scope remember it only in a
private attribute; tensor and pipeline parallelism need it to find the
models they must lay out, and training unsharded would be the silent
result of a rename, so each accessor checks what it reads.
"""

import functools
import inspect

import tensorflow as tf

from tfpar._compat.checks import Incompatible
from tfpar._compat.checks import require
from tfpar._compat.keras_modules import backend
from tfpar._compat.keras_modules import tf_trainer

require(tf_trainer.TensorFlowTrainer, "_aggregate_additional_loss",
        "the pipeline's loss")

TensorFlowTrainer = tf_trainer.TensorFlowTrainer


def model_strategy(model):
  """The `tf.distribute.Strategy` a model was created under (Keras records
  it at creation); raises `Incompatible` if Keras no longer does."""
  return require(model, "_distribute_strategy",
                 "the strategy a model was created under")


def compiled_loss(model):
  """The model's compiled loss function (`loss_fn(y, y_pred,
  sample_weight)`), or None when compiled without a loss."""
  return require(model, "_compile_loss", "the pipeline's loss")


def scaled_layer_loss(model, loss):
  """A layer's `add_loss` value as Keras's step adds it to the loss."""
  return model._aggregate_additional_loss(loss)  # pylint: disable=protected-access


def loss_tracker(model):
  """The metric `fit` logs as "loss"."""
  return require(model, "_loss_tracker", "the logged loss")


# The name Keras gives the graph its shape inference traces into.
_SHAPE_INFERENCE_GRAPH = "scratch_graph"


@functools.cache
def _check_shape_inference_graph():
  if _SHAPE_INFERENCE_GRAPH not in inspect.getsource(
      backend.compute_output_spec):
    raise Incompatible(
        f"tfpar recognizes Keras's shape inference by its graph's name "
        f"{_SHAPE_INFERENCE_GRAPH!r}, which this Keras's "
        f"compute_output_spec no longer uses; update "
        f"tfpar/_compat/keras_trainer.py.")


def in_shape_inference():
  """Whether ops are being traced into the throw-away graph of Keras's
  shape inference (`compute_output_spec`: a functional model's layer
  calls, `fit` building a model), which never runs."""
  _check_shape_inference_graph()
  name = getattr(tf.compat.v1.get_default_graph(), "name", "")  # FuncGraph.
  return name.startswith(_SHAPE_INFERENCE_GRAPH)


# The value Keras reduces in `_maybe_symbolic_build` before it builds the
# model (checked in its source when the hook is installed).
_SYMBOLIC_BUILD_REDUCE = "distribute_strategy.reduce("


def install_symbolic_build_batch(batch_for):
  """Makes Keras's symbolic build take its batch from the strategy.

  Before `fit`, `evaluate` or `predict` builds a model, Keras's TensorFlow
  trainer (`_maybe_symbolic_build`) draws one distributed batch and calls
  `strategy.reduce("MEAN", batch, axis=None)` on the whole nested batch,
  only to read its shapes and dtypes. A preprocessor's batch has boolean
  parts (keras-hub's `padding_mask`), which no all-reduce takes: every
  `tf.distribute` strategy fails there (`Value for attr 'T' of bool`).
  With this hook, a strategy whose `extended` has
  `symbolic_build_batch(batch)` gives the batch Keras builds from; other
  strategies keep Keras's reduce. The batch is drawn only when Keras's
  `_symbolic_build` needs one (a layer, the compiled loss or metrics not
  built yet): Keras draws it before every `fit`, `evaluate` and `predict`,
  and the distributed iterator it opens for it is dropped at once, which
  crashed TensorFlow (a segmentation fault in `EpochIterator.reset`, seen
  in 2 of 3 suite runs under load, in `evaluate` after `fit`).

  Args:
    batch_for: `batch_for(strategy)` returns the strategy's
      `symbolic_build_batch` function, or None for Keras's own behaviour.

  Raises:
    Incompatible: this Keras no longer has the method, its `data_batch`
      argument, or no longer reduces the batch there.
  """
  if getattr(TensorFlowTrainer, "_tfpar_symbolic_build_batch", False):
    return
  original = require(TensorFlowTrainer, "_maybe_symbolic_build",
                     "the batch Keras builds a model from")
  if ("data_batch" not in inspect.signature(original).parameters or
      _SYMBOLIC_BUILD_REDUCE not in inspect.getsource(original)):
    raise Incompatible(
        f"tfpar replaces the batch Keras's "
        f"TensorFlowTrainer._maybe_symbolic_build reduces across replicas "
        f"(its `data_batch` argument, `{_SYMBOLIC_BUILD_REDUCE}...`), which "
        f"this Keras changed; update tfpar/_compat/keras_trainer.py.")

  symbolic_build = require(TensorFlowTrainer, "_symbolic_build",
                           "building a model before its first run")
  if "iterator" not in inspect.signature(symbolic_build).parameters:
    raise Incompatible(
        "tfpar hands Keras's TensorFlowTrainer._symbolic_build an iterator "
        "it draws from only when it builds; this Keras's takes no "
        "`iterator`; update tfpar/_compat/keras_trainer.py.")

  @functools.wraps(original)
  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = require(self, "_distribute_strategy",
                       "the strategy a model was created under")
    convert = batch_for(strategy) if strategy is not None else None
    if convert is None or iterator is None:
      return original(self, iterator=iterator, data_batch=data_batch)

    def first_batch():  # Drawn only if `_symbolic_build` iterates it.
      for _, _, batches in iterator:
        yield None, None, [convert(next(batches))]
        return

    with strategy.scope():
      symbolic_build(self, iterator=first_batch())

  TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build  # pylint: disable=protected-access
  TensorFlowTrainer._tfpar_symbolic_build_batch = True  # pylint: disable=protected-access
