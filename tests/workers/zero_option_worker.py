"""Worker script for test_zero_option_multi_worker.py, run by `tfpar launch`.

Builds a seeded MLP in the scope of `DataParallelStrategy(mesh,
zero=tfpar.ZeRO(stage=3))` on the TF_CONFIG mesh and trains it a few SGD
steps, while every TensorFlow variable this process creates is counted per
device, independently of tfpar (`variable_accounting`), from the first
variable to the end of training. Then trains the same model, drawn with the
same seed, on one device of this process, and writes to
`OUT_DIR/worker<i>.json` the peak and final bytes per device, the largest
weight's bytes, and to `OUT_DIR/worker<i>.npz` the initial and trained
weights (`get_weights()`, and `numpy()` of `model.weights`) of both.
First builds the model with another seed on worker 1, and records the
error of that build (the workers' draws must agree).

Usage: zero_option_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top
import numpy as np

import tfpar
from variable_accounting import VariableAccounting

SEED, FEATURES, BATCH, STEPS = 11, 16, 32, 4


def mlp(seed=SEED):
  """Keras's seeded initializers; odd sizes, so slices are padded; no
  weight is more than a quarter of the model."""
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((FEATURES,))]
  for index, width in enumerate((36, 37, 36, 37, 36)):
    layers.append(keras.layers.Dense(width, activation="tanh",
                                     name=f"hidden{index}"))
  model = keras.Sequential(layers + [keras.layers.Dense(1, name="out")])
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  return model


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, FEATURES)).astype("float32")
  y = np.tanh(x @ rng.normal(size=(FEATURES, 1))).astype("float32")
  return x, y


def train(model):
  x, y = data()
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def different_seeds_error():
  """The error of a build whose workers drew different initial values
  (worker 1 with another seed), or None."""
  strategy = tfpar.DataParallelStrategy(
      tfpar.Mesh.from_cluster_resolver(data=-1), zero=tfpar.ZeRO(stage=3))
  seed = SEED + strategy.mesh.cluster.task_id
  try:
    with strategy.scope():
      mlp(seed)
  except ValueError as error:
    return str(error)
  return None


def main():
  out_dir = sys.argv[1]
  refused = different_seeds_error()
  accounting = VariableAccounting()
  with accounting.counting():
    strategy = tfpar.DataParallelStrategy(
        tfpar.Mesh.from_cluster_resolver(data=-1), zero=tfpar.ZeRO(stage=3))
    with strategy.scope():
      model = mlp()
      # Whole weights before the model is prepared: gathered (a
      # collective on every worker), then each worker's slices assigned.
      drawn = model.get_weights()
      model.set_weights(drawn)
    initial = model.get_weights()  # Prepared: ZeRO-3's slices, gathered.
    train(model)
    final = accounting.now()
  trained = model.get_weights()
  numpy_values = [w.numpy() for w in model.weights]
  reference = mlp()  # One device of this process, outside the strategy.
  reference_initial = reference.get_weights()
  train(reference)
  task = strategy.mesh.cluster.task_id
  with open(os.path.join(out_dir, f"worker{task}.json"), "w") as f:
    json.dump({"peak": dict(accounting.peak), "final": final,
               "largest": max(w.nbytes for w in reference_initial),
               "replicas": strategy.num_replicas_in_sync,
               "different_seeds": refused}, f)
  arrays = {}
  for name, values in (("drawn", drawn), ("initial", initial),
                       ("trained", trained),
                       ("numpy", numpy_values),
                       ("reference_initial", reference_initial),
                       ("reference", reference.get_weights())):
    for index, value in enumerate(values):
      arrays[f"{name}_{index}"] = value
  np.savez(os.path.join(out_dir, f"worker{task}.npz"), **arrays)
  print("peak", dict(accounting.peak), "final", final, flush=True)


if __name__ == "__main__":
  main()
