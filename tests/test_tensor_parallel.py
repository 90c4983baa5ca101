"""TensorParallelStrategy trains the same model as one device.

Each layout trains the GPT and the MLP of tp_common with Adam and gradient
clipping for 24 steps and is compared with the same model trained without a
strategy: the loss of every step, every logical weight, evaluate and
predict.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfpar
import tp_common

LAYOUTS = [{"data": 2, "tensor": 2}, {"data": 1, "tensor": 4}]
# GPT: global norm clipping; MLP: per-weight norm clipping (over the whole
# logical weight, not each shard).
CLIPPING = {"gpt": {"global_clipnorm": 0.5}, "mlp": {"clipnorm": 0.05}}
BUILDERS = {"gpt": tp_common.gpt, "mlp": tp_common.mlp}


def _trained(name, layout=None):
  """(strategy, model, step losses) of `name` trained one device (layout
  None) or tensor parallel; the GPT's runs are tp_common's shared ones."""
  if name == "gpt":
    run = tp_common.trained_gpt(layout)
    return run.strategy, run.model, run.losses
  build = lambda: tp_common.compile_model(BUILDERS[name](), **CLIPPING[name])
  x, y = tp_common.data(name)
  strategy = None if layout is None else tfpar.TensorParallelStrategy(
      tfpar.Mesh(layout))
  if strategy is None:
    model = build()
  else:
    with strategy.scope():
      model = build()
  return strategy, model, tp_common.step_losses(model, x, y)


@pytest.fixture(scope="module")
def references():
  return {name: _trained(name)[1:] for name in BUILDERS}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(
    f"{k}{v}" for k, v in l.items()))
def test_trains_like_one_device(references, name, layout):
  reference, reference_losses = references[name]
  strategy, model, losses = _trained(name, layout)
  assert strategy.num_replicas_in_sync == layout["data"]
  assert len(losses) == 24
  tp_common.assert_trains_like(model, losses, reference, reference_losses)
  # Keras's own list reads the same whole weights, in one device's order.
  assert [w.path for w in model.weights] == [w.path for w in
                                              reference.weights]
  for got, want in zip(model.weights, reference.weights):
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0,
                               err_msg=want.path)
  assert model.count_params() == reference.count_params()
  x, y = tp_common.data(name, count=20, seed=7)  # 20: an uneven last batch.
  np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                             reference.predict(x, batch_size=8, verbose=0),
                             atol=1e-5, rtol=0)
  np.testing.assert_allclose(
      model.evaluate(x, y, batch_size=8, verbose=0),
      reference.evaluate(x, y, batch_size=8, verbose=0), atol=1e-5, rtol=0)


def test_shards_live_on_their_devices():
  run = tp_common.trained_gpt({"data": 2, "tensor": 2})  # Fitted.
  strategy, model = run.strategy, run.model
  groups = strategy.mesh.replicas
  # Shard 1's gradients were all-reduced by a collective on the shard-1
  # devices (shard 0's by the replica heads' own).
  assert set(strategy.extended._column_ops) == {1}  # pylint: disable=protected-access
  kernel = model.get_layer("block0_mlp_in")._kernel  # pylint: disable=protected-access
  # The layer's kernel is one variable of the shard's shape whose
  # component on the k-th device of every group holds shard k of the whole
  # weight; its Adam slots have the same components.
  devices = [d for group in groups for d in group]
  t = len(groups[0])
  whole = kernel._tfpar_shard_of[0]  # pylint: disable=protected-access
  assert isinstance(whole, tfpar.ShardedWeight) and whole.shape == (16, 64)
  assert tuple(kernel.shape) == (16, 32)
  pieces = np.split(whole.numpy(), t, axis=1)
  components = kernel.value.values
  assert [c.device for c in components] == devices
  for index, component in enumerate(components):
    np.testing.assert_array_equal(component.numpy(), pieces[index % t])
  slots = [v for v in model.optimizer.variables
           if v.name.startswith("block0_mlp_in_kernel_")]
  assert len(slots) == 2  # Adam's moments.
  for slot in slots:
    assert tuple(slot.shape) == (16, 32)
    assert [c.device for c in slot.value.values] == devices


def test_backward_runs_on_the_shard_devices():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 1,
                                                      "tensor": 4}))
  with strategy.scope():
    model = tp_common.mlp()
  strategy.extended.prepare_pending_models()
  x, y = tp_common.data("mlp", count=8)

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
      return tape.gradient(loss, model.trainable_variables)
    return strategy.run(replica_step, args=(x, y))

  graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
  matmuls = {}
  for op in graph.get_operations():
    if op.type == "MatMul":
      matmuls.setdefault(op.device, []).append(op.name)
  devices = strategy.mesh.replicas[0]
  # Each device: 4 forward matmuls (one per Dense shard) and the backward
  # matmuls of its own shards (dW and dx of each), none on another device.
  counts = [len(matmuls.get(d, [])) for d in devices]
  assert counts == [counts[0]] * 4, matmuls.keys()
  # Every device traces the step on its shards: 4 forward matmuls, 4
  # kernel gradients and 3 input gradients (the first layer's input is the
  # data), nowhere else.
  gradient_matmuls = [n for d in devices for n in matmuls[d]
                      if "grad" in n.lower()]
  assert counts == [11] * 4 and len(gradient_matmuls) == 7 * 4, matmuls
  assert sum(counts) == sum(len(v) for v in matmuls.values())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(
    f"{k}{v}" for k, v in l.items()))
def test_megatron_communication_per_step(layout):
  # The log of the shared run: what one traced step emits.
  run = tp_common.trained_gpt(layout)
  log = run.log
  blocks, t = tp_common.BLOCKS, layout["tensor"]
  embeddings = 2  # Token and position tables, vocabulary-parallel.
  batch = tp_common.BATCH // layout["data"]
  activation = batch * tp_common.SEQUENCE * tp_common.WIDTH * 4
  # Each of the t devices of a group runs Megatron's all-reduces among
  # the group (2 per block and the embeddings' forward, 2 per block
  # backward) plus one of global_clipnorm's squared norm (a float32
  # scalar), sending 2 (t - 1) / t of each in the ring.
  strategy = run.strategy
  t = strategy.extended.tensor_size
  records = log.step_records()
  assert sorted({r.tensor.device for r in records}) == sorted(
      strategy.mesh.replicas[0])
  assert log.counts() == {
      ("all-reduce", "forward"): t * (2 * blocks + embeddings),
      ("all-reduce", "backward"): t * (2 * blocks + 1),
  }
  ring = lambda nbytes: 2 * (t - 1) * nbytes // t
  assert log.bytes() == {
      ("all-reduce", "forward"): t * (2 * blocks + embeddings) *
                                 ring(activation),
      ("all-reduce", "backward"): t * (2 * blocks * ring(activation) +
                                       ring(4)),
  }
  assert sorted(r.layer for r in records if r.bytes == ring(4)) == [
      "global_clipnorm"] * t


def test_describe_lists_every_variable():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = tp_common.gpt()
  text = strategy.describe(model, print_fn=lambda line: None)
  lines = text.splitlines()
  assert lines[0].split() == ["variable", "full", "shape", "style", "shard",
                              "shape", "devices"]
  rows = {line.split()[0]: line for line in lines[2:-4]}
  assert sorted(rows) == sorted(v.path for v in tp_common.gpt().weights)
  assert lines[-4].startswith("split over the tensor axis: ")
  assert lines[-3].startswith("replicated (") and "block0_ln1/gamma" in lines[
      -3] and "block0_mlp_in/kernel" not in lines[-3]
  assert lines[-1] == ("training: policy float32; not compiled")
  assert ("(16, 64)    ColumnParallel axis 1  (16, 32)     "
          "0: CPU:0,CPU:2 | 1: CPU:1,CPU:3") in rows["block0_mlp_in/kernel"]
  assert "RowParallel axis 0" in rows["block0_mlp_out/kernel"]
  assert "Replicate" in rows["block0_mlp_out/bias"]
  assert "(4, 4, 16)  RowParallel axis 0     (2, 4, 16)" in rows[
      "block0_attention/attention_output/kernel"]
  assert "ColumnParallel axis 1  (16, 2, 4)" in rows[
      "block0_attention/query/kernel"]
  assert "VocabParallel axis 0   (16, 16)" in rows["tokens/embeddings"]
  assert "Replicate" in rows["block0_ln1/gamma"]
  # The same table before and after sharding.
  model.predict(tp_common.data("gpt", count=8)[0], verbose=0)
  assert strategy.describe(model, print_fn=lambda line: None) == text


def test_memory_report_splits_sharded_weights_and_slots():
  x, y = tp_common.data("mlp", count=16)
  reference = tp_common.compile_model(tp_common.mlp())
  reference.fit(tp_common.dataset(x, y), epochs=1, verbose=0)
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 1,
                                                      "tensor": 4}))
  with strategy.scope():
    model = tp_common.compile_model(tp_common.mlp())
  model.fit(tp_common.dataset(x, y), epochs=1, verbose=0)
  one_device = tfpar.memory_report(reference)
  report = tfpar.memory_report(model)
  devices = strategy.mesh.replicas[0]
  assert report.devices == sorted(devices)
  # Sharded: both Dense pairs' kernels and the column layers' biases.
  # Bytes of the whole (one device's) weights.
  sharded = sum(4 * int(np.prod(reference.get_layer(n).kernel.shape))
                for n in ("pair1_in", "pair1_out", "pair2_in", "pair2_out"))
  sharded += 4 * (64 + 32)
  replicated = sum(one_device.parameters.values()) - sharded
  # Replicated weights, the step counter and the learning rate are on
  # every device.
  extra = sum(one_device.optimizer.values()) - 2 * (sharded + replicated)
  assert extra > 0
  for device in devices:
    expected = sharded // 4 + replicated
    assert report.parameters[device] == expected
    # Adam: two slots per weight.
    slots = 2 * expected
    assert report.optimizer[device] - slots == extra
