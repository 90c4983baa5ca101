"""Checkpoints of a tensor-parallel model hold whole logical tensors and
reshard: a checkpoint written by tensor 2 x data 2 loads into tensor 4,
tensor 1 and no strategy at all, with the Adam moments, so training goes
on with the losses the original run has."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
import tp_common

# One block has every kind of layer a checkpoint reshards (vocabulary-
# parallel embeddings, split attention and MLP, replicated LayerNorms and
# head): what these tests check is the checkpoint, so the GPT is tp_common's
# with one block instead of two, which halves its tracing.
BLOCKS = 1
TARGETS = {
    "tensor4": {"data": 1, "tensor": 4},
    "tensor1": {"data": 4, "tensor": 1},
    "no_strategy": None,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A model trained one epoch under tensor 2 x data 2, saved three ways,
  and the losses of its next epoch."""
  directory = tmp_path_factory.mktemp("tp_checkpoints")
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(blocks=BLOCKS))
  x, y = tp_common.data("gpt")
  model.fit(tp_common.dataset(x, y), epochs=1, verbose=0)
  paths = {
      "weights_h5": str(directory / "model.weights.h5"),
      "keras": str(directory / "model.keras"),
  }
  model.save_weights(paths["weights_h5"])
  model.save(paths["keras"])
  paths["tf_checkpoint"] = tf.train.Checkpoint(
      model=model, optimizer=model.optimizer).save(str(directory / "ckpt"))
  predictions = model.predict(x[:16], verbose=0)
  next_losses = tp_common.step_losses(model, x, y, epochs=1)
  return paths, predictions, next_losses


def _fresh_model(layout):
  """A compiled GPT with its optimizer built, under `layout` (or none)."""
  if layout is None:
    model = tp_common.compile_model(tp_common.gpt(blocks=BLOCKS, seed=11))
    model.optimizer.build(model.trainable_variables)
    return model
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh(layout))
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt(blocks=BLOCKS, seed=11))
  with strategy.scope():
    model.optimizer.build(model.trainable_variables)
  return model


def _load(kind, path, layout, model=None):
  """The checkpoint at `path` loaded under `layout`: a .keras file makes
  its model; the others load into `model` (default: a fresh one)."""
  if kind == "keras":
    if layout is None:
      return keras.models.load_model(path)
    with tfpar.TensorParallelStrategy(tfpar.Mesh(layout)).scope():
      return keras.models.load_model(path)
  model = model or _fresh_model(layout)
  if kind == "weights_h5":
    model.load_weights(path)
  else:
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
        path).assert_existing_objects_matched()
  return model


def test_checkpoint_has_the_entries_of_an_unsharded_model(saved, tmp_path):
  paths, _, _ = saved
  plain = _fresh_model(None)
  plain_path = tf.train.Checkpoint(model=plain,
                                   optimizer=plain.optimizer).save(
                                       str(tmp_path / "plain"))
  entries = dict(tf.train.list_variables(paths["tf_checkpoint"]))
  assert entries == dict(tf.train.list_variables(plain_path))
  shapes = list(entries.values())
  assert shapes.count([16, 64]) == 3  # The MLP's kernel and its 2 moments.
  assert [16, 2, 4] not in shapes  # No attention shard.


def _assert_split(model, path, tensor):
  """`model.weights` lists the weight at `path` whole, held as `tensor`
  column shards (the head design's shard variables, or spmd's per-device
  components of one variable)."""
  weight, = [w for w in model.weights if w.path == path]
  assert isinstance(weight, tfpar.ShardedWeight), weight
  whole = list(weight.shape)
  assert len(weight.shards) == tensor
  for shard in weight.shards:
    assert [whole[0], whole[1] // tensor] == list(shard.shape)


# A .keras file makes its own model. The other two kinds load into an
# existing model, so one model per target takes both in turn: the second
# load must replace all the first load and its fit left behind.
KINDS = {"keras": ["keras"],
         "weights_h5+tf_checkpoint": ["weights_h5", "tf_checkpoint"]}


@pytest.mark.parametrize("kinds", sorted(KINDS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_checkpoint_reshards_with_optimizer_state(saved, kinds, target):
  paths, predictions, next_losses = saved
  layout = TARGETS[target]
  x, y = tp_common.data("gpt")
  model = None
  for kind in KINDS[kinds]:
    model = _load(kind, paths[kind], layout, model)
    if layout is not None and layout["tensor"] > 1:
      _assert_split(model, "block0_mlp_in/kernel", layout["tensor"])
    np.testing.assert_allclose(model.predict(x[:16], verbose=0),
                               predictions, atol=1e-5, rtol=0, err_msg=kind)
    # Equal losses after the restore only if the Adam moments (and step
    # count) came back too: a fresh Adam state changes the first update.
    np.testing.assert_allclose(tp_common.step_losses(model, x, y, epochs=1),
                               next_losses, atol=1e-5, rtol=0, err_msg=kind)


def test_without_the_moments_training_diverges(saved):
  """The check above can fail: with a fresh optimizer the losses differ."""
  paths, _, next_losses = saved
  model = tp_common.compile_model(tp_common.gpt(blocks=BLOCKS, seed=11))
  model.load_weights(paths["weights_h5"], skip_mismatch=False)
  model.compile(optimizer=keras.optimizers.Adam(0.01),
                loss=model.loss)
  x, y = tp_common.data("gpt")
  losses = tp_common.step_losses(model, x, y, epochs=1)
  assert np.max(np.abs(losses - next_losses)) > 1e-3
