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
