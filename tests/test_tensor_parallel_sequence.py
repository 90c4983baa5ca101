"""sequence_parallel=True: same results as one device, the same bytes as
plain tensor parallelism, and the LayerNorm regions run on sequence
slices."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import suite_scope
import tfpar
import tp_common

# Tensor 4 with TFPAR_TEST_FULL=1: test_tensor_spmd_sequence trains
# keras-hub Llama on data 1 x tensor 4 with sequence parallelism under
# SPMD (the default), with the same per-device byte checks.
LAYOUTS = suite_scope.cases([{"data": 2, "tensor": 2}],
                            [{"data": 1, "tensor": 4}])
IDS = ["data2xtensor2", "data1xtensor4"][:len(LAYOUTS)]


@pytest.fixture(scope="module")
def reference():
  run = tp_common.trained_gpt()
  return run.model, run.losses


def _gpt(layout, sequence_parallel=True):
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh(layout), sequence_parallel=sequence_parallel)
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(), global_clipnorm=0.5)
  return strategy, model


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_sequence_parallel_trains_like_one_device(reference, layout):
  expected_model, expected_losses = reference
  run = tp_common.trained_gpt(layout, sequence_parallel=True)
  model = run.model
  np.testing.assert_allclose(run.losses, expected_losses, atol=1e-5, rtol=0)
  expected = tfpar.logical_weights(expected_model)
  actual = tfpar.logical_weights(model)
  for path in expected:
    np.testing.assert_allclose(actual[path], expected[path], atol=1e-5,
                               rtol=0, err_msg=path)
  px, py = tp_common.data("gpt", count=20, seed=7)
  np.testing.assert_allclose(model.predict(px, batch_size=8, verbose=0),
                             expected_model.predict(px, batch_size=8,
                                                    verbose=0), atol=1e-5)
  np.testing.assert_allclose(
      model.evaluate(px, py, batch_size=8, verbose=0),
      expected_model.evaluate(px, py, batch_size=8, verbose=0), atol=1e-5)


def _step_log(layout, sequence_parallel):
  """What one traced training step emits: the log of the shared run."""
  return tp_common.trained_gpt(layout, sequence_parallel).log


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_reduce_scatter_and_all_gather_replace_the_all_reduces(layout):
  log = _step_log(layout, sequence_parallel=True)
  blocks, embeddings = tp_common.BLOCKS, 2
  # Per device of a group (t of them): Megatron's all-reduces
  # become a reduce-scatter and an all-gather of the same tensor, each
  # sending (t - 1) / t of it where the all-reduce sent 2 (t - 1) / t, so
  # the same bytes; the vocabulary head all-gathers the final LayerNorm's
  # slices, and the weights applied to slices (every LayerNorm's gamma and
  # beta, the row-parallel biases) have their gradients all-reduced over
  # the group, as does global_clipnorm's squared norm.
  t = layout["tensor"]
  norms = 2 * blocks + 1  # LayerNormalization layers.
  assert log.counts() == {
      ("reduce-scatter", "forward"): t * (2 * blocks + embeddings),
      ("all-gather", "backward"): t * (2 * blocks + embeddings),
      ("all-gather", "forward"): t * (2 * blocks + 1),
      ("reduce-scatter", "backward"): t * 2 * blocks,
      ("all-reduce", "backward"): t * (2 * norms + 2 * blocks + 1),
  }
  plain = log.bytes()
  dense = _step_log(layout, sequence_parallel=False).bytes()
  batch = tp_common.BATCH // layout["data"]
  activation = batch * tp_common.SEQUENCE * tp_common.WIDTH * 4
  ring = lambda nbytes: 2 * (t - 1) * nbytes // t
  head_gather = t * (t - 1) * activation // t
  clipnorm = t * ring(4)
  # g: forward all-reduce -> reduce-scatter, its gradient an all-gather.
  assert (plain[("reduce-scatter", "forward")] +
          plain[("all-gather", "backward")] ==
          dense[("all-reduce", "forward")])
  # f: backward all-reduce -> forward all-gather and its reduce-scatter.
  assert (plain[("all-gather", "forward")] - head_gather +
          plain[("reduce-scatter", "backward")] ==
          dense[("all-reduce", "backward")] - clipnorm)
  assert plain[("all-reduce", "backward")] == (
      t * (2 * norms + 2 * blocks) * ring(tp_common.WIDTH * 4) + clipnorm)


def test_layer_norm_runs_on_sequence_slices():
  strategy, model = _gpt({"data": 1, "tensor": 4})
  x, y = tp_common.data("gpt", count=8)

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
      return tape.gradient(loss, model.trainable_variables)
    return strategy.run(replica_step, args=(x, y))

  graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
  devices = strategy.mesh.replicas[0]
  layer_norm_ops = [op for op in graph.get_operations()
                    if "block1_ln2" in op.name and op.type == "Mean"]
  assert {op.device for op in layer_norm_ops} == set(devices)
  slice_length = tp_common.SEQUENCE // 4
  for op in layer_norm_ops:
    assert op.inputs[0].shape[1] == slice_length, op.name


def test_sequence_not_divisible_by_tensor_size_is_an_error():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 4}),
                                          sequence_parallel=True)
  with strategy.scope():
    inputs = keras.Input((6, 8))
    x = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="down")(x))
    model.compile(optimizer="adam", loss="mse")
  with pytest.raises(ValueError, match=r"layer 'down' outputs sequence "
                     r"length 6, not divisible by the tensor size 4"):
    model.fit(np.zeros((4, 6, 8)), np.zeros((4, 6, 8)), verbose=0)


def test_sequence_parallel_must_be_a_bool():
  with pytest.raises(ValueError, match="sequence_parallel must be True or "
                     "False"):
    tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 2}),
                                 sequence_parallel="yes")
