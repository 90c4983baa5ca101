"""DataParallelStrategy on one host with 4 virtual CPUs, against one device."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import dp_common
import tfpar

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def data():
  return dp_common.make_data()


@pytest.fixture(scope="module")
def reference(data):
  """The one-device run every layout must reproduce."""
  x, y = data
  model = dp_common.build_model()
  losses = dp_common.step_losses(model, x, y)
  return model, losses


def _data_parallel_model(mesh=None, strategy_class=tfpar.DataParallelStrategy):
  strategy = strategy_class(mesh or tfpar.Mesh({"data": 4}))
  with strategy.scope():
    model = dp_common.build_model()
  return strategy, model


def _max_weight_difference(a, b):
  return max(np.max(np.abs(u - v)) for u, v in zip(a.get_weights(),
                                                  b.get_weights()))


def test_fit_equals_one_device(data, reference):
  x, y = data
  ref_model, ref_losses = reference
  strategy, model = _data_parallel_model()
  assert strategy.num_replicas_in_sync == 4
  losses = dp_common.step_losses(model, x, y)
  assert len(losses) == 24
  np.testing.assert_allclose(losses, ref_losses, atol=TOLERANCE)
  assert _max_weight_difference(model, ref_model) < TOLERANCE
  # Every replica's copy of every variable is the same.
  for variable in model.weights:
    copies = [v.numpy() for v in variable.value.values]
    assert len(copies) == 4
    for copy in copies[1:]:
      np.testing.assert_array_equal(copy, copies[0])


def test_evaluate_predict_and_validation_equal_one_device(data, reference):
  x, y = data
  ref_model, _ = reference
  _, model = _data_parallel_model()
  model.set_weights(ref_model.get_weights())
  np.testing.assert_allclose(
      model.evaluate(x, y, batch_size=32, verbose=0),
      ref_model.evaluate(x, y, batch_size=32, verbose=0), atol=TOLERANCE)
  # 100 rows: the last batch does not split evenly over 4 replicas.
  np.testing.assert_allclose(
      model.predict(x[:100], batch_size=32, verbose=0),
      ref_model.predict(x[:100], batch_size=32, verbose=0), atol=TOLERANCE)

  one_device = dp_common.build_model()
  ref_history = dp_common.fit(one_device, x, y, epochs=1,
                              validation_data=(x[:64], y[:64]))
  _, model = _data_parallel_model()
  history = dp_common.fit(model, x, y, epochs=1,
                          validation_data=(x[:64], y[:64]))
  for key in ("loss", "mae", "val_loss", "val_mae"):
    np.testing.assert_allclose(history[key], ref_history[key], atol=TOLERANCE)


def test_save_and_load_weights_round_trip(tmp_path, data, reference):
  x, _ = data
  ref_model, _ = reference
  _, model = _data_parallel_model()
  model.set_weights(ref_model.get_weights())
  path = str(tmp_path / "dp.weights.h5")
  model.save_weights(path)
  # Load into a fresh data-parallel model and into a model with no strategy.
  _, loaded = _data_parallel_model()
  loaded.load_weights(path)
  plain = dp_common.build_model(seed=7)
  plain.load_weights(path)
  expected = ref_model.predict(x[:64], verbose=0)
  np.testing.assert_allclose(loaded.predict(x[:64], verbose=0), expected,
                             atol=TOLERANCE)
  np.testing.assert_allclose(plain.predict(x[:64], verbose=0), expected,
                             atol=TOLERANCE)


@pytest.mark.parametrize("module", [keras.callbacks, tfpar])
def test_model_checkpoint_and_backup_and_restore(tmp_path, data, reference,
                                                 module):
  """Interrupt a fit, resume it from the backup, land on the same weights."""
  x, y = data
  uninterrupted, _ = reference  # The same model fitted EPOCHS epochs.

  class Interrupt(keras.callbacks.Callback):

    def on_epoch_begin(self, epoch, logs=None):
      if epoch == 2:
        raise RuntimeError("interrupted")

  backup_dir = str(tmp_path / "backup")
  checkpoints = str(tmp_path / "ckpt" / "epoch{epoch}.weights.h5")
  callbacks = [module.BackupAndRestore(backup_dir),
               module.ModelCheckpoint(checkpoints, save_weights_only=True)]
  _, model = _data_parallel_model()
  with pytest.raises(RuntimeError, match="interrupted"):
    dp_common.fit(model, x, y, callbacks=callbacks + [Interrupt()])
  assert sorted(os.listdir(tmp_path / "ckpt")) == [
      "epoch1.weights.h5", "epoch2.weights.h5"]

  _, resumed = _data_parallel_model()
  history = dp_common.fit(resumed, x, y, callbacks=callbacks)
  assert len(history["loss"]) == 1  # Only the third epoch ran again.
  assert _max_weight_difference(resumed, uninterrupted) < TOLERANCE


def test_mesh_strategy_replicas_are_device_groups(data, reference):
  """The engine with 2-device replicas: data 2 x tensor 2."""
  x, y = data
  ref_model, ref_losses = reference
  mesh = tfpar.Mesh({"data": 2, "tensor": 2})
  strategy, model = _data_parallel_model(mesh, tfpar.engine.MeshStrategy)
  assert strategy.num_replicas_in_sync == 2
  groups = strategy.extended.worker_devices_by_replica
  assert [[d[-5:] for d in g] for g in groups] == [["CPU:0", "CPU:1"],
                                                   ["CPU:2", "CPU:3"]]
  assert strategy.extended.worker_devices == (mesh.replicas[0][0],
                                              mesh.replicas[1][0])

  def replica_group_is_second():
    group = tf.distribute.get_replica_context().devices[0]
    return tf.constant(tuple(group) == mesh.replicas[1])

  results = strategy.experimental_local_results(
      strategy.run(replica_group_is_second))
  assert [bool(r) for r in results] == [False, True]
  losses = dp_common.step_losses(model, x, y)
  np.testing.assert_allclose(losses, ref_losses, atol=TOLERANCE)
  assert _max_weight_difference(model, ref_model) < TOLERANCE


def test_data_parallel_rejects_model_parallel_axes():
  with pytest.raises(ValueError, match=r"only the 'data' axis.*tensor=2"):
    tfpar.DataParallelStrategy(tfpar.Mesh({"data": 2, "tensor": 2}))
  with pytest.raises(ValueError, match="needs a tfpar.Mesh"):
    tfpar.DataParallelStrategy({"data": 4})


def test_two_strategies_in_one_process(data):
  """Each instance gets its own collective keys."""
  x, y = data
  for _ in range(2):
    _, model = _data_parallel_model(tfpar.Mesh({"data": 2}, _first_devices(2)))
    dp_common.fit(model, x, y, epochs=1)
  _, model = _data_parallel_model()
  dp_common.fit(model, x, y, epochs=1)


def _first_devices(count):
  return tfpar.Mesh().devices[:count]


def test_a_built_model_draws_no_batch_to_build_from(monkeypatch):
  # Keras draws a distributed batch before every fit, evaluate and predict
  # only to build the model; the iterator it opened for it was dropped at
  # once, which crashed TensorFlow under load (EpochIterator.reset).
  # tfpar draws it only while something is left to build.
  drawn = []
  build_batch = tfpar.engine.MeshExtended.symbolic_build_batch
  monkeypatch.setattr(tfpar.engine.MeshExtended, "symbolic_build_batch",
                      lambda self, batch: drawn.append(1) or build_batch(
                          self, batch))
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
  x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
  model.fit(x, y, batch_size=4, verbose=0)
  assert len(drawn) == 1  # The compiled loss and metrics were unbuilt.
  model.evaluate(x, y, batch_size=4, verbose=0)
  model.predict(x, batch_size=4, verbose=0)
  model.fit(x, y, batch_size=4, verbose=0)
  assert len(drawn) == 1
