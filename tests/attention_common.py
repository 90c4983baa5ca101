"""Training a small model on one device and under data 2 x tensor 2, and
counting per-device bytes, for the attention-tracing and vision tests."""

import keras
import numpy as np
import tensorflow as tf

import hub_common
import one_device_optimizer
import tfpar

LAYOUT = {"data": 2, "tensor": 2}
STEPS = 4
BATCH = 8


def train(build, x, y, strategy=None):
  """(model, weights after STEPS SGD steps) of `build()` seeded alike."""
  scope = strategy.scope() if strategy else tf.distribute.get_strategy(
      ).scope()
  with scope:
    keras.utils.set_random_seed(1)
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  one_device_optimizer.build(model)
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  return model, model.get_weights()


def compare(build, x, y):
  """(reference model, sharded model, largest weight difference, strategy)."""
  reference, expected = train(build, x, y)
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh(LAYOUT))
  model, got = train(build, x, y, strategy)
  assert [w.shape for w in got] == [w.shape for w in expected]
  worst = max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
  return reference, model, worst, strategy


def halved_on_every_device(model, reference, path, strategy):
  """Whether weight `path` is held as half its bytes on each device of a
  tensor group, counted from the per-device variables."""
  whole = sum(hub_common.bytes_by_device(reference, path).values())
  held = hub_common.bytes_by_device(model, path)
  return all(held[d] * 2 == whole for d in strategy.mesh.replicas[0])


def fullest_and_megatron(model, reference, halved):
  """(the fullest device's bytes, Megatron's share: the weights `halved`
  accepts halved, the others whole), counted independently of tfpar."""
  fullest = max(hub_common.bytes_by_device(model).values())
  share = 0
  for weight in reference.weights:
    size = int(np.prod(weight.shape)) * np.dtype(weight.dtype).itemsize
    share += size / 2 if halved(weight) else size
  return fullest, share
