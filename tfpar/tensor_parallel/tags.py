"""Tensors tagged with the per-device parts they were gathered from.

A column-parallel layer returns its output gathered onto the head and
tagged with its shards; a row-parallel layer (or a sequence-parallel
region) that receives such a tensor takes the parts directly, so
TensorFlow prunes the unused gather from the traced step (Megatron's f/g
pairs). A tag names the split's axis and devices: a consumer that splits
another way, or on other devices, gets None and uses the whole tensor.
"""

import dataclasses

from tfpar._compat.keras_modules import tensor_attributes

_SPLIT_ATTRIBUTE = "_tfpar_split"
_SEQUENCE_ATTRIBUTE = "_tfpar_sequence"
SEQUENCE_AXIS = 1


@dataclasses.dataclass(frozen=True)
class _Split:
  parts: tuple
  axis: int  # Negative: counted from the last axis.
  devices: tuple


def _tag(tensor, attribute, parts, axis, devices):
  tensor_attributes.set_tensor_attr(
      tensor, attribute, _Split(tuple(parts), axis, tuple(devices)))
  return tensor


def _parts(tensor, attribute, axis, devices):
  split = tensor_attributes.get_tensor_attr(tensor, attribute)
  if split is not None and split.axis == axis and split.devices == tuple(
      devices):
    return list(split.parts)
  return None


def tag_split(tensor, parts, axis, devices):
  """Marks `tensor` as gathered from the per-device `parts` along `axis`
  (a split layer's output); returns `tensor`."""
  return _tag(tensor, _SPLIT_ATTRIBUTE, parts, axis, devices)


def split_parts(tensor, axis, devices):
  """The per-device parts `tensor` was gathered from along `axis` on
  `devices`, or None."""
  return _parts(tensor, _SPLIT_ATTRIBUTE, axis, devices)


def tag_sequence(tensor, chunks, devices):
  """Marks `tensor` as gathered from the sequence slices `chunks`; returns
  `tensor`."""
  return _tag(tensor, _SEQUENCE_ATTRIBUTE, chunks, SEQUENCE_AXIS, devices)


def sequence_chunks(tensor, devices):
  """The sequence slices `tensor` was gathered from, or None."""
  return _parts(tensor, _SEQUENCE_ATTRIBUTE, SEQUENCE_AXIS, devices)
