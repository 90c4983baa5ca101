"""A pipeline's activation recomputation (`recompute=True`) runs each
stage's call a second time in the backward pass. What the call assigns
(batch normalization's moving statistics) must take each micro-batch once,
and nothing else may be copied: a LoRA model's frozen base is most of its
bytes, and a copy of it per micro-batch would undo what recomputation
saves. Counted in the traced training step itself, independently of
tfpar: its variable assignments with recomputation against without."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import pp_common
import tfpar

_ASSIGNMENTS = ("AssignVariableOp", "AssignAddVariableOp",
                "AssignSubVariableOp")
MICROBATCHES = 2
DATA = 2  # Replicas, each running the pipeline (its own copy of the step).


class GraphRecorder(keras.layers.Layer):
  """Identity that records the traced graphs (not eager calls, not Keras's
  symbolic build) it is called in."""

  graphs = []

  def call(self, x):
    graph = tf.compat.v1.get_default_graph()
    if hasattr(graph, "outer_graph") and graph not in self.graphs:
      self.graphs.append(graph)
    return x


def _lora_chain(batch_norm):
  """pp_common's residual chain (2 blocks) behind a GraphRecorder, its
  Dense layers LoRA-adapted (frozen kernels), optionally with a
  BatchNormalization after the first block."""
  base = pp_common.residual_chain(blocks=2)
  inputs = keras.Input((pp_common.WIDTH,), name="features")
  x = GraphRecorder(name="recorder")(inputs)
  for layer in base.layers[1:]:
    if isinstance(layer, keras.layers.Add):
      x = layer([x, h])
      if batch_norm and layer.name == "block0_add":
        x = keras.layers.BatchNormalization(name="norm")(x)
    elif layer.name.endswith("_in"):
      h = layer(x)
    elif layer.name.endswith("_out"):
      h = layer(h)
    else:
      x = layer(x)
  model = keras.Model(inputs, x, name="lora_chain")
  for layer in model.layers:
    if isinstance(layer, keras.layers.Dense) and layer.name != "head":
      layer.enable_lora(2, a_initializer=keras.initializers.RandomNormal(
          stddev=0.3, seed=1))
      layer.lora_kernel_b.assign(
          np.full(layer.lora_kernel_b.shape, 0.05, "float32"))
  return model


def _train(strategy, batch_norm):
  GraphRecorder.graphs.clear()
  result = pp_common.train(
      strategy, model_fn=functools.partial(_lora_chain, batch_norm),
      epochs=2)
  # The training step has the most assignments of the graphs traced
  # (the optimizer's updates; evaluate and predict have none or few).
  step = max(GraphRecorder.graphs, key=_assignments)
  return result, _assignments(step)


def _assignments(graph):
  return sum(op.type in _ASSIGNMENTS for op in graph.get_operations())


def _pipeline(recompute):
  return tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": DATA, "pipeline": 2}), num_microbatches=MICROBATCHES,
      schedule="1f1b", recompute=recompute)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_recomputed_stages_assign_only_their_state_once(batch_norm):
  recomputed, with_recompute = _train(_pipeline(True), batch_norm)
  stored, without_recompute = _train(_pipeline(False), batch_norm)
  # Each stage normalizes per micro-batch (docs/pipeline.md), so with
  # batch normalization the reference is the pipeline storing activations.
  reference = stored if batch_norm else _train(None, batch_norm)[0]
  pp_common.assert_same_training(reference, recomputed)
  model = recomputed[-1]
  frozen = [v for v in model.non_trainable_variables if v.dtype == "float32"
            and "moving" not in v.path]
  assert len(frozen) == 5  # Every LoRA-adapted kernel, never copied.
  # Per replica and micro-batch, the stage holding the normalization
  # assigns its moving mean and variance again when recomputed, and
  # restores them after: nothing else is assigned.
  again = DATA * MICROBATCHES * 2 * 2 if batch_norm else 0
  assert with_recompute - without_recompute == again
