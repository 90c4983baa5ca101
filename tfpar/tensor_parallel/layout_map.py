"""A sharding plan read from a `keras.distribution.LayoutMap`."""

from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import plan as plan_lib
from tfpar.tensor_parallel import styles


class LayoutMapPlan(plan_lib.ShardingPlan):
  """A `tfpar.ShardingPlan` read from a `keras.distribution.LayoutMap`.

  Args:
    layout_map: the `LayoutMap`.
    model_axis: the mesh axis that splits weights (tfpar's `tensor`).
  """

  def __init__(self, layout_map, model_axis):
    super().__init__(())
    self._layout_map = layout_map
    self._model_axis = model_axis

  def _layout(self, path):
    layout = self._layout_map[path]
    return None if layout is None else tuple(layout.axes)

  def _user_styles(self, model):
    # Keras keeps unmapped weights whole; a bias the map leaves out of a
    # layer whose kernel it splits follows its kernel, as in Megatron.
    split_layers = {variable.path.rpartition("/")[0]
                    for variable in model.weights
                    if self._model_axis in (self._layout(variable.path) or ())}
    replicate = {}
    for variable in model.weights:
      axes = self._layout(variable.path)
      if axes is None and variable.path.rpartition("/")[0] in split_layers:
        continue
      if axes is None or self._model_axis not in axes:
        replicate[variable.path] = (
            styles.REPLICATE,
            f"LayoutMap {axes}" if axes else "not in the LayoutMap")
    return replicate

  def resolve(self, model, tensor_size, elsewhere=()):
    resolved = super().resolve(model, tensor_size, elsewhere)
    # Megatron's answer to fewer key/value heads than devices (each device
    # computes the head its query heads share) carries out a split too.
    split = {v.path for layout in resolved for v in layout.variables
             if v.axis is not None or
             families.SHARED_KEY_VALUE in v.source}
    for variable in model.weights:
      axes = self._layout(variable.path)
      if axes and self._model_axis in axes and variable.path not in split:
        raise ValueError(
            f"The LayoutMap splits weight {variable.path!r} {axes} over "
            f"the {self._model_axis!r} axis, but tfpar cannot split it: its "
            f"layer is not one tfpar's tensor-parallel plans split, or the "
            f"rest of its layer is kept whole. Map it to None on that axis "
            f"(replicated) or split its whole layer.")
    return resolved

  def __repr__(self):
    return f"LayoutMapPlan(model_axis={self._model_axis!r})"
