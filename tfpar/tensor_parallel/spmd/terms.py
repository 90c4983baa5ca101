"""Regularizers and constraints of split layers under SPMD.

A split weight is one Keras variable whose value in each trace is the
device's shard, so Keras adds `variable.regularizer(shard)` to each
device's loss and applies `variable.constraint(shard)` to each shard
(`piece_terms` says which terms that is exact for, and refuses the rest).
Each device's loss must still be one device's loss, which holds the term
of the whole weight: a shard's term is summed over the tensor group
forward (Megatron's `g`), and backward each shard keeps its own gradient.
The same holds for the activity regularizer of a split layer whose output
stays split (a column-parallel layer feeding a row-parallel one; sequence
slices).
"""

import copy

from tfpar.common import piece_terms
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel import variables as variables_lib


def check(layer_layouts, paired, sequence_parallel):
  """Refuses terms that cannot be computed shard by shard, before any
  weight is split.

  Args:
    layer_layouts: the resolved `LayerLayout`s.
    paired: the column -> row layers whose activations stay split
      (`layers.paired_layers`).
    sequence_parallel: the strategy's `sequence_parallel` (split layers'
      outputs may be sequence slices).

  Raises:
    ValueError: a split weight's regularizer or constraint, or the
      activity regularizer of a layer whose output is split, does not act
      on each piece alone (names the weight or layer, the term and the
      rule).
  """
  for layout in layer_layouts:
    owners = variables_lib.owners_of(layout.layer)
    for variable_layout in layout.variables:
      if variable_layout.axis is not None:
        piece_terms.check_splittable(owners[variable_layout.path][1],
                                     variable_layout.axis)
    if _output_may_be_split(layout, paired, sequence_parallel):
      piece_terms.check_activity_splittable(layout.layer)


def _output_may_be_split(layout, paired, sequence_parallel):
  column = isinstance(layout.style, styles.ColumnParallel) and (
      layout.kind in (layouts.DENSE, layouts.EINSUM))
  return sequence_parallel or (column and layout.layer in paired)


class _SummedOverGroup:
  """Mixed into a copy of a sum-over-elements regularizer (its class kept
  for `get_config` and serialization): the term of this device's piece,
  summed over the tensor group in a step (gradient: the piece's own);
  outside a step, of the whole weight if there is one."""

  def __call__(self, x):
    if collectives.current_slot() is None:
      whole = self._tfpar_whole
      return super().__call__(x if whole is None else whole.value)
    term = super().__call__(x)
    if self._tfpar_partial is not None and not self._tfpar_partial(x):
      return term
    return collectives.g(self._tfpar_groups, term, self._tfpar_name)


def summed_over_group(regularizer, groups, name, whole=None, partial=None):
  """`regularizer` (L1, L2 or L1L2) summing its pieces' terms over the
  tensor group.

  Args:
    regularizer: a Keras regularizer that is a sum over elements.
    groups: the strategy's `collectives.TensorGroups`.
    name: what the communication log records (a layer or weight name).
    whole: the weight's whole view, read outside a step; None for
      activations.
    partial: None (every value is a piece) or `partial(x)`, whether `x`
      is one (a sequence slice).

  Returns:
    A regularizer of the same class and config.
  """
  base = type(regularizer)
  summed = copy.copy(regularizer)
  summed.__class__ = type(base.__name__, (_SummedOverGroup, base), {
      "__module__": base.__module__, "__qualname__": base.__qualname__})
  summed._tfpar_groups = groups  # pylint: disable=protected-access
  summed._tfpar_name = name  # pylint: disable=protected-access
  summed._tfpar_whole = whole  # pylint: disable=protected-access
  summed._tfpar_partial = partial  # pylint: disable=protected-access
  return summed


def carry_over(variable, weight, groups):
  """Gives `weight`'s SPMD variable the regularizer and constraint of the
  unsplit `variable` it replaces (checked by `check`).

  Args:
    variable: the unsplit Keras variable.
    weight: its `SpmdWeight`.
    groups: the strategy's `collectives.TensorGroups`.
  """
  piece_terms.carry_over(variable, [weight.variable])
  if weight.variable.regularizer is not None:
    weight.variable.regularizer = summed_over_group(
        weight.variable.regularizer, groups, weight.path, whole=weight)


def sum_activity_terms(layer, memo, split):
  """Makes the activity regularizer of split `layer` count its whole
  output when the output is split.

  Args:
    layer: a split layer.
    memo: the strategy's `Memo`.
    split: whether its output is always split (a paired column-parallel
      layer); else only sequence slices are.
  """
  regularizer = getattr(layer, "activity_regularizer", None)
  if regularizer is None or isinstance(regularizer, _SummedOverGroup):
    return
  if split:
    partial = None
  elif memo.slices is not None:
    partial = memo.slices.is_sliced
  else:
    return
  layer.activity_regularizer = summed_over_group(
      regularizer, memo.groups, layer.name, partial=partial)
