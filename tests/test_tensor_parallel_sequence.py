"""sequence_parallel=True: same results as one device, the same bytes as
plain tensor parallelism, and the LayerNorm regions run on sequence
slices."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
import tp_common

LAYOUTS = [{"data": 2, "tensor": 2}, {"data": 1, "tensor": 4}]
IDS = ["data2xtensor2", "data1xtensor4"]


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
  counts = log.counts()
  assert counts == {
      # Token ids go out whole; every reduce becomes a reduce-scatter and
      # every broadcast of an activation an all-gather.
      ("broadcast", "forward"): embeddings,
      ("reduce-scatter", "forward"): 2 * blocks + embeddings,
      ("all-gather", "forward"): 2 * blocks,
      ("reduce-scatter", "backward"): 2 * blocks,
      ("all-gather", "backward"): 2 * blocks + embeddings,
      # The replicated vocabulary head takes the whole final activation.
      ("gather", "forward"): 1,
      ("scatter", "backward"): 1,
  }
  plain = log.bytes()
  dense = _step_log(layout, sequence_parallel=False).bytes()
  # Same bytes for the transformer blocks and embeddings as reduce +
  # broadcast.
  assert (plain[("reduce-scatter", "forward")] ==
          dense[("reduce", "forward")])
  assert (plain[("all-gather", "forward")] +
          plain[("broadcast", "forward")] == dense[("broadcast", "forward")])
  assert (plain[("reduce-scatter", "backward")] ==
          dense[("reduce", "backward")])
  assert (plain[("all-gather", "backward")] ==
          dense[("broadcast", "backward")])


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
