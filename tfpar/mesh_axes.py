"""The axes of a `tfpar.Mesh` and how their sizes resolve against a
device count."""

import enum

import numpy as np


class MeshAxis(str, enum.Enum):
  """The names of mesh axes, outermost first."""

  DATA = "data"
  PIPELINE = "pipeline"
  TENSOR = "tensor"


AXES = tuple(axis.value for axis in MeshAxis)


class SizeMismatch(ValueError):
  """Axis sizes that do not multiply to the number of devices."""


def axis_position(axis):
  """The index of `axis` (a name or `MeshAxis`) in `AXES`."""
  axis = axis.value if isinstance(axis, MeshAxis) else axis
  if axis not in AXES:
    raise ValueError(f"Unknown mesh axis {axis!r}; the axes are {AXES}.")
  return AXES.index(axis)


def resolve_sizes(axis_sizes, num_devices):
  """{axis: size} for every axis, with -1 and missing axes resolved.

  Args:
    axis_sizes: {axis: size} (None: all devices on "data").
    num_devices: how many devices the sizes must multiply to.

  Raises:
    ValueError: an unknown axis or a bad size; `SizeMismatch` when the
      sizes do not multiply to `num_devices`.

  >>> resolve_sizes({"data": -1, "tensor": 2}, 8)["data"]
  4
  """
  if axis_sizes is None:
    axis_sizes = {"data": -1}
  if not hasattr(axis_sizes, "items"):
    raise ValueError(
        "Mesh axis sizes must be a mapping like {'data': 2, 'tensor': 2}. "
        f"Received: {axis_sizes!r}")
  shape = dict.fromkeys(AXES, 1)
  for axis, size in axis_sizes.items():
    axis = axis.value if isinstance(axis, MeshAxis) else axis
    if axis not in AXES:
      raise ValueError(f"Unknown mesh axis {axis!r}; the axes are {AXES}.")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (
        size < 1 and size != -1):
      raise ValueError(
          f"Mesh axis '{axis}' must have a positive integer size or -1 "
          f"(inferred). Received: {axis}={size!r}")
    shape[axis] = int(size)
  inferred = [a for a, n in shape.items() if n == -1]
  if not inferred and "data" not in axis_sizes and MeshAxis.DATA not in (
      axis_sizes):
    shape["data"], inferred = -1, ["data"]
  if len(inferred) > 1:
    raise ValueError(
        f"At most one mesh axis may be -1. Received: {inferred} are all -1.")
  known = int(np.prod([n for n in shape.values() if n != -1]))
  if inferred:
    if num_devices % known:
      raise SizeMismatch(
          f"Cannot infer mesh axis '{inferred[0]}': {num_devices} devices "
          f"are not divisible by the other axes' product {known}.")
    shape[inferred[0]] = num_devices // known
  elif known != num_devices:
    raise SizeMismatch(
        f"Mesh shape {shape} needs {known} devices but {num_devices} are "
        f"available.")
  return shape
