"""Weight bytes per device while a model is built, for each layout.

tfpar creates each weight where it will live (`tfpar/engine/spread.py`):
from the first variable created to the end of the first step, a device
holds at most (measured in tests/test_weights_created_in_place.py):

* tensor parallelism, and ZeRO-3 from `DataParallelStrategy(mesh,
  zero=tfpar.ZeRO(stage=3))` on one node: its final share of the weights
  plus one whole weight in transit;
* pipelines: the larger of its final share and 1/(pipeline x tensor) of
  the model (weights are created spread before the cut is known), plus two
  whole weights;
* plain data parallelism, ZeRO-1/2, and ZeRO-3 as a `fit` callback (across
  nodes, or over tensor / pipeline layouts, where it slices the data axis
  only when `fit` starts): the weights of its replica, whole.
"""

import math

import numpy as np


def _bytes_per_element(precision):
  # Keras keeps float32 variables under every policy; "mixed" is the ZeRO
  # paper's fp16 weights.
  return 2 if precision == "mixed" else 4


def largest_weight(profile):
  """Elements of the model's largest weight (0 for a parameter count)."""
  model = getattr(profile, "model", None)
  if model is None:
    return 0
  return max((int(np.prod(v.shape)) for v in model.weights), default=0)


def build_peak_bytes(layout, loads, profile, precision, node_size):
  """Bytes of weights on the fullest device while the model is built.

  Args:
    layout: the `tfpar.planner.Layout`.
    loads: its `StageLoad`s (elements per device of each stage, before
      ZeRO).
    profile: the model's profile (`KerasProfile` or `CountProfile`).
    precision: one of `formulas.PRECISIONS`.
    node_size: devices per node (ZeRO-3 creates sliced weights inside a
      node only).

  Returns:
    An int: bytes.

  Example:

  >>> from tfpar.planner import Layout
  >>> from tfpar.planner.profile import CountProfile
  >>> profile = CountProfile(1000)
  >>> loads = profile.stages(tensor=1, pipeline=1)
  >>> build_peak_bytes(Layout(data=4), loads, profile, "fp32", 8)
  4000
  >>> build_peak_bytes(Layout(data=4, zero=3), loads, profile, "fp32", 8)
  1000
  """
  per_element = _bytes_per_element(precision)
  transit = largest_weight(profile) * per_element
  final = max(per_element * load.trainable + 4 * load.non_trainable
              for load in loads)
  if layout.tensor == 1 and layout.pipeline == 1:
    if layout.zero == 3 and layout.devices <= node_size:
      load = loads[0]
      share = per_element * math.ceil(load.trainable / layout.data)
      return share + 4 * load.non_trainable + transit
    return final
  if layout.pipeline == 1:
    return final + transit
  # Each device's share of the whole model, created spread over a replica.
  spread = per_element * sum(load.trainable for load in loads) / (
      layout.pipeline)
  return int(max(final, spread) + 2 * transit)
