"""A global batch that does not split over the data replicas is refused.

Was: "Shape mismatch in the collective instance 100" from inside the first
step (Keras reduces the first batch of fit / evaluate across replicas), on
one host and across TF_CONFIG workers.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import launch_common
import tfpar


def _model(strategy):
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
  return model


def test_uneven_batch_is_refused_before_any_step():
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  model = _model(strategy)
  x, y = np.ones((120, 4), "float32"), np.ones((120, 1), "float32")
  rule = (r"batch_size=30 does not split evenly over the data size 4 .*"
          r"multiple of 4, e.g. 28 or 32")
  with pytest.raises(ValueError, match=rule):
    model.fit(x, y, batch_size=30, verbose=0)
  with pytest.raises(ValueError, match=rule):
    model.evaluate(x, y, batch_size=30, verbose=0)
  assert model.optimizer.iterations.numpy() == 0
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6).prefetch(1)
  with pytest.raises(ValueError, match=r"the dataset's batch size=6 does not "
                     r"split evenly over the data size 4"):
    model.fit(dataset, verbose=0)
  # Even global batches still train, with a last partial batch (102 rows).
  history = model.fit(x[:102], y[:102], batch_size=32, verbose=0)
  assert np.isfinite(history.history["loss"][0])
  assert model.optimizer.iterations.numpy() == 4


_WORKER = """\
import keras, numpy as np, tfpar
strategy = tfpar.DataParallelStrategy(tfpar.Mesh.from_cluster_resolver())
with strategy.scope():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile(optimizer="adam", loss="mse")
try:
  model.fit(np.ones((60, 4)), np.ones((60, 1)), batch_size=6, verbose=0)
except ValueError as e:
  print("refused:", e, flush=True)
"""


def test_uneven_batch_across_workers_is_refused_on_every_worker(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  run = launch_common.launch_ok(
      script, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  for index in range(2):
    assert (f"[worker {index}] refused: batch_size=6 does not split evenly "
            f"over the data size 4" in run.stdout), run.stdout[-3000:]
  assert "Shape mismatch" not in run.stdout
