"""Resolved layouts: which style every variable got, and its shard shape."""

import dataclasses
from typing import Optional, Tuple

from tfpar.tensor_parallel import styles

# What a sharded layer computes.
DENSE = "Dense"
EINSUM = "EinsumDense"
EMBEDDING = "Embedding"
ATTENTION = "MultiHeadAttention"
HEADS = "AttentionHeads"  # A registered attention layer's own call, by heads.


@dataclasses.dataclass(frozen=True)
class VariableLayout:
  """How one variable is laid out over the `tensor` axis.

  Attributes:
    path: the Keras variable path, e.g. `"block0_mlp_in/kernel"`.
    shape: the full (logical) shape.
    style: the `tfpar` style it resolved to.
    axis: the axis it is split on, or None when every replica holds it whole.
    source: the rule or built-in plan that decided it.
  """
  path: str
  shape: Tuple[int, ...]
  style: styles.Style
  axis: Optional[int]
  source: str

  def shard_shape(self, tensor_size):
    """The shape of one shard on a `tensor` axis of `tensor_size`."""
    if self.axis is None:
      return tuple(self.shape)
    shape = list(self.shape)
    shape[self.axis] //= tensor_size
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class LayerLayout:
  """How one layer runs: its kind, its style and its variables' layouts.

  Attributes:
    layer: the Keras layer.
    kind: DENSE, EINSUM, EMBEDDING, ATTENTION or HEADS.
    style: the layer's style (for attention, ColumnParallel means split by
      heads: query/key/value column-, output row-parallel).
    variables: the `VariableLayout` of each of its variables, in the order
      `layer.weights` had before sharding.
    letter: for EinsumDense, the einsum letter of the split axis.
  """
  layer: object
  kind: str
  style: styles.Style
  variables: Tuple[VariableLayout, ...]
  letter: Optional[str] = None

  @property
  def is_sharded(self):
    return not isinstance(self.style, styles.Replicate)


def einsum_letters(equation):
  """(input, kernel, output) letter strings of an EinsumDense equation,
  without any leading '...'."""
  lhs, output = equation.split("->")
  inputs, kernel = lhs.split(",")
  strip = lambda s: s.replace("...", "")
  return strip(inputs), strip(kernel), strip(output)


def einsum_split_letter(equation, style):
  """The letter a column (first output-only) or row (first contracted) split
  of an EinsumDense kernel cuts, or None when there is none."""
  inputs, kernel, output = einsum_letters(equation)
  for letter in kernel:
    if isinstance(style, styles.ColumnParallel):
      if letter in output and letter not in inputs:
        return letter
    elif letter in inputs and letter not in output:
      return letter
  return None


def activation_split_axis(layer, style):
  """The (negative) activation axis a COLUMN split of a Dense or EinsumDense
  `layer` leaves split in its output, or a ROW split needs split in its
  input; None if its equation has no such axis."""
  if not hasattr(layer, "equation"):  # Dense: the features, last.
    return -1
  letter = einsum_split_letter(layer.equation, style)
  if letter is None:
    return None
  inputs, _, output = einsum_letters(layer.equation)
  letters = output if isinstance(style, styles.ColumnParallel) else inputs
  return letters.index(letter) - len(letters)
