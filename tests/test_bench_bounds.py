"""The arithmetic of benchmarks/bounds.py: the graph's matmul FLOP count,
the ring all-reduce bytes and the bound (no timing)."""

import os
import sys

import keras
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import bounds  # pylint: disable=g-import-not-at-top,wrong-import-position


def _flops_of(fn, *shapes):
  graph = tf.function(fn).get_concrete_function(
      *(tf.TensorSpec(s) for s in shapes)).graph
  return sum(bounds._op_flops(op) for op in graph.get_operations())  # pylint: disable=protected-access


def test_matmul_batch_matmul_and_einsum_flops():
  assert _flops_of(tf.matmul, (3, 4), (4, 5)) == 2 * 3 * 4 * 5
  assert _flops_of(lambda a, b: tf.matmul(a, b, transpose_a=True),
                   (4, 3), (4, 5)) == 2 * 3 * 4 * 5
  assert _flops_of(tf.matmul, (2, 3, 4), (2, 4, 5)) == 2 * 2 * 3 * 4 * 5
  assert _flops_of(lambda a, b: tf.einsum("abc,cd->abd", a, b),
                   (2, 3, 4), (4, 5)) == 2 * 2 * 3 * 5 * 4
  assert _flops_of(lambda a, b: tf.einsum("...qhd,...khd->...hqk", a, b),
                   (2, 3, 4, 8), (2, 6, 4, 8)) == 2 * (2 * 4 * 3 * 6) * 8
  assert _flops_of(lambda a: tf.einsum("abc->cba", a), (2, 3, 4)) == 0


def test_mlp_forward_and_backward_flops():
  batch, sizes = 8, (6, 5, 3)
  model = keras.Sequential([keras.Input((sizes[0],)),
                            keras.layers.Dense(sizes[1]),
                            keras.layers.Dense(sizes[2])])
  x = tf.zeros((batch, sizes[0]))
  y = tf.zeros((batch, sizes[2]))
  flops, kinds = bounds.graph_flops(model, x, y,
                                    keras.losses.MeanSquaredError())
  forward = 2 * batch * (6 * 5 + 5 * 3)
  # Weight gradients of both layers; the input gradient of the second
  # only (the first layer's input needs none).
  assert flops == 2 * forward + 2 * batch * 5 * 3
  assert kinds == {"MatMul": 5}


def test_ring_bytes_and_bound():
  assert bounds.ring_all_reduce_bytes(400, 4) == 600
  assert bounds.ring_all_reduce_bytes(400, 1) == 0
  machine = bounds.Machine.__new__(bounds.Machine)
  machine.rates = {"float32": (1e9, 2e9)}
  machine.bandwidth = 1e9
  assert machine.bound(4e9, 5e8) == (2.0, 0.5, 2.5)
