"""A weight's regularizer and constraint, carried to the pieces it is split
into (tensor shards, expert ranks).

Keras adds `variable.regularizer(variable)` of every trainable weight to
the loss and applies `variable.constraint` after every update. When a
weight is split, its pieces must carry both, or the split model silently
trains without them. That is exact only when the term is a sum over the
elements (`L1`, `L2`, `L1L2`: the pieces' terms add up to the whole
weight's) or the constraint acts on each piece alone (`NonNeg`; a norm
constraint whose norm runs along axes that are not split). Anything else
is refused before training starts.
"""

import keras

_SUMS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
_NORMS = (keras.constraints.MaxNorm, keras.constraints.UnitNorm,
          keras.constraints.MinMaxNorm)


def check_splittable(variable, split_axis):
  """Raises a ValueError if `variable`'s regularizer or constraint cannot
  be applied to its pieces split along `split_axis`.

  Example:

  >>> import keras
  >>> from tfpar.common.piece_terms import check_splittable
  >>> layer = keras.layers.Dense(
  ...     4, kernel_regularizer=keras.regularizers.OrthogonalRegularizer(),
  ...     name="proj")
  >>> layer.build((None, 2))
  >>> check_splittable(layer.kernel, 1)
  Traceback (most recent call last):
  ...
  ValueError: Weight 'proj/kernel' is split over devices along axis 1, but its regularizer OrthogonalRegularizer is not a sum over elements, so it cannot be computed piece by piece. Use L1, L2 or L1L2, or keep the weight whole (replicated) in the plan.
  """
  regularizer = getattr(variable, "regularizer", None)
  if regularizer is not None and type(regularizer) not in _SUMS:
    raise ValueError(
        f"Weight {variable.path!r} is split over devices along axis "
        f"{split_axis}, but its regularizer {type(regularizer).__name__} is "
        f"not a sum over elements, so it cannot be computed piece by piece. "
        f"Use L1, L2 or L1L2, or keep the weight whole (replicated) in the "
        f"plan.")
  constraint = getattr(variable, "constraint", None)
  if constraint is None or type(constraint) is keras.constraints.NonNeg:
    return
  if type(constraint) in _NORMS:
    axes = constraint.axis if isinstance(constraint.axis, (list, tuple)) \
        else [constraint.axis]
    rank = len(variable.shape)
    if split_axis % rank not in [a % rank for a in axes]:
      return
  raise ValueError(
      f"Weight {variable.path!r} is split over devices along axis "
      f"{split_axis}, but its constraint {type(constraint).__name__} does "
      f"not act on each piece alone (NonNeg does, and norm constraints whose "
      f"norm does not run along the split axis). Remove the constraint or "
      f"keep the weight whole (replicated) in the plan.")


def check_activity_splittable(layer):
  """Raises a ValueError if the activity regularizer of `layer`, whose
  output is split over devices, is not a sum over elements.

  Example:

  >>> import keras
  >>> from tfpar.common.piece_terms import check_activity_splittable
  >>> check_activity_splittable(keras.layers.Dense(
  ...     4, activity_regularizer=keras.regularizers.L1(0.1)))
  """
  regularizer = getattr(layer, "activity_regularizer", None)
  if regularizer is not None and type(regularizer) not in _SUMS:
    raise ValueError(
        f"Layer {layer.name!r} has its output split over devices, but its "
        f"activity_regularizer {type(regularizer).__name__} is not a sum "
        f"over elements, so it cannot be computed piece by piece. Use L1, "
        f"L2 or L1L2, or keep the layer whole (replicated) in the plan.")


def carry_over(variable, pieces):
  """Gives each piece `variable`'s regularizer and constraint (checked
  with `check_splittable` before the split).

  Args:
    variable: the whole Keras variable.
    pieces: the Keras variables of its pieces.
  """
  for piece in pieces:
    piece.regularizer = getattr(variable, "regularizer", None)
    piece.constraint = getattr(variable, "constraint", None)
