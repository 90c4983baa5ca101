"""Trains a classifier data-parallel with tfpar, on one host or many workers.

One host, 4 virtual CPUs (no GPU needed), data generated on the spot:

  python examples/train_data_parallel.py

The same script across 2 local TF_CONFIG workers with 2 virtual CPUs each:

  tfpar launch --workers 2 --devices-per-worker 2 examples/train_data_parallel.py

With the network, any TFDS image classification dataset works too:

  python examples/train_data_parallel.py --dataset=mnist
"""

import os

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfpar

FLAGS = flags.FLAGS
flags.DEFINE_string("dataset", "synthetic",
                    "'synthetic' (generated, no download) or a TFDS name.")
flags.DEFINE_integer("devices", 4, "Virtual CPUs on a CPU-only host when not "
                     "run by `tfpar launch`.")
flags.DEFINE_integer("epochs", 3, "Training epochs.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
flags.DEFINE_integer("examples", 4096, "Synthetic examples to generate.")
flags.DEFINE_integer("seed", 0, "Seed of the model's initial weights "
                     "(keras.utils.set_random_seed), so a run can be repeated.")


def synthetic_classification(examples, features=32, classes=10, seed=0):
  """Gaussian clusters, one per class: learnable, reproducible, no download."""
  rng = np.random.default_rng(seed)
  centers = rng.normal(scale=0.4, size=(classes, features))
  labels = rng.integers(0, classes, size=examples)
  x = centers[labels] + rng.normal(size=(examples, features))
  return x.astype("float32"), labels.astype("int32"), classes


def tfds_classification(name):
  """A TFDS image classification dataset as flat float features."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  (images, labels), info = tfds.load(name, split="train", as_supervised=True,
                                     batch_size=-1, with_info=True)
  x = tf.reshape(tf.cast(images, tf.float32) / 255.0, [images.shape[0], -1])
  return x.numpy(), labels.numpy(), info.features["label"].num_classes


def main(argv):
  del argv
  if not os.environ.get("TF_CONFIG") and not tf.config.list_physical_devices(
      "GPU"):
    tfpar.configure_virtual_cpus(FLAGS.devices)
  mesh = tfpar.Mesh.from_cluster_resolver(data=-1)
  strategy = tfpar.DataParallelStrategy(mesh)
  print(mesh)

  if FLAGS.dataset == "synthetic":
    x, y, classes = synthetic_classification(FLAGS.examples)
  else:
    x, y, classes = tfds_classification(FLAGS.dataset)
  split = len(x) * 9 // 10

  keras.utils.set_random_seed(FLAGS.seed)
  with strategy.scope():
    model = keras.Sequential([
        keras.Input(x.shape[1:]),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
  model.fit(x[:split], y[:split], batch_size=FLAGS.batch_size,
            epochs=FLAGS.epochs, validation_data=(x[split:], y[split:]),
            verbose=2)
  loss, accuracy = model.evaluate(x[split:], y[split:], verbose=0)
  print(f"{strategy.num_replicas_in_sync} replicas on {mesh.num_workers} "
        f"worker(s): validation loss {loss:.4f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
  app.run(main)
