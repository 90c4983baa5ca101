"""A traced step's graph is released when nothing uses it any more.

`tf.custom_gradient` (tfpar's collectives, Keras's int8 Dense) registers
each traced gradient in TensorFlow's process-wide registry, which used to
keep every retraced step's graph, model and optimizer alive
(`tfpar/_compat/custom_gradients.py`).
"""

import gc
import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

import tfpar
from tfpar._compat.custom_gradients import registered_custom_gradients as _registered_custom_gradients


def _live_function_graphs():
  return sum(1 for obj in gc.get_objects() if type(obj).__name__ == "FuncGraph")


def _train_once():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2, "tensor": 2}))
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile("sgd", "mse")
  model.fit(np.ones((16, 8), "float32"), np.ones((16, 4), "float32"),
            batch_size=8, verbose=0)
  return model


def test_retraced_parallel_steps_leave_no_graph_behind():
  _train_once()
  gc.collect()
  graphs, names = _live_function_graphs(), _registered_custom_gradients()
  model = _train_once()
  # The live model's step uses custom gradients (the collectives), so this
  # test counts something.
  assert _registered_custom_gradients() > names
  del model
  for _ in range(2):
    _train_once()
  gc.collect()
  assert _live_function_graphs() <= graphs
  assert _registered_custom_gradients() <= names


def test_a_function_differentiated_after_its_trace_finds_its_gradient():
  tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2, "tensor": 2}))

  @tf.custom_gradient
  def doubled(x):
    return 2.0 * x, lambda upstream: 3.0 * upstream

  @tf.function
  def forward(x):
    return doubled(x) + x

  x = tf.constant(1.5)
  forward(x)  # Traced here; its backward is built below, after a collection.
  gc.collect()
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = forward(x)
  assert float(tape.gradient(y, x)) == 4.0


def test_making_a_strategy_installs_the_release(tmp_path):
  """The test process installs it up front (conftest); a user's process
  does when its first tfpar strategy is made."""
  script = tmp_path / "probe.py"
  script.write_text(
      "import tfpar\n"
      "from tfpar._compat import custom_gradients\n"
      "before = custom_gradients.installed()\n"
      "tfpar.DataParallelStrategy()\n"
      "print(before, custom_gradients.installed())\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(tfpar.__file__)),
       os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, str(script)], env=env, timeout=120,
                          capture_output=True, text=True, check=True)
  assert result.stdout.split()[-2:] == ["False", "True"]
