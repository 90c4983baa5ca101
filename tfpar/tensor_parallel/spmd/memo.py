"""The per-trace memory of the SPMD layers: Megatron's `f` made once per
replicated tensor, the sequence slices, and which replicated weights have
partial gradients (summed over the tensor group before the data
all-reduce).
"""

import weakref

from tfpar._compat import keras_layers
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import rounding
from tfpar.tensor_parallel.spmd import sequence


class Memo:
  """`f` of each replicated tensor, once per trace, and with sequence
  parallelism the sequence slices (cleared per step trace by the
  strategy).

  Args:
    groups: the strategy's `collectives.TensorGroups`.
    sequence_parallel: whether row-parallel outputs are reduce-scattered
      along the sequence.
    float32_sums: under a half-precision policy, add partial sums in
      float32 (`communication_dtype="float32"`).
  """

  def __init__(self, groups, sequence_parallel=False, float32_sums=False):
    self.groups = groups
    self.outputs = {}
    # Replicated weights whose gradient on each device is partial (applied
    # to sequence slices, or a key/value head shared by several devices):
    # summed over the tensor group before the data all-reduce. Kept across
    # steps, weakly: {id(storage): storage}, an entry dropped when its
    # storage dies (tfpar.ZeRO(stage=3) replacing it), so an old storage is
    # neither kept alive nor confused with a new one given its id().
    self.partial_weights = weakref.WeakValueDictionary()
    self.slices = sequence.Slices(groups, float32_sums,
                                  self.partial_weights) if (
                                      sequence_parallel) else None
    self.float32_sums = float32_sums

  def mark_partial(self, variables):
    """Records replicated `variables` as having partial gradients."""
    for variable in variables:
      storage = keras_layers.storage(variable, variable)
      self.partial_weights[id(storage)] = storage

  def wide(self, layer):
    """Whether `layer` adds its partial sums in float32 (a half-precision
    compute dtype and the strategy's `communication_dtype="float32"`)."""
    return self.float32_sums and layer.compute_dtype in ("bfloat16",
                                                        "float16")

  def f_wide(self, x, layer):
    """`f` of a float32 copy of half-precision `x`, one copy per split
    projection `layer` reading it: each projection's input gradient is
    summed over the group in float32 and rounded alone, by its copy's
    cast, as one device rounds each projection's input gradient before
    adding them (one all-reduce per projection). A sequence slice is gathered once for all of them."""
    sliced = self.slices is not None and (
        self.slices.is_sliced(x) or x.ref() in self.slices.gathered or
        _cast_of(x, self.slices.gathered))
    key = ("wide", x.ref(), None if sliced else layer)
    if key not in self.outputs:
      wide = rounding.widened(x)
      if self.slices is not None and self.slices.is_sliced(x):
        out = self.slices.for_split_layer(wide, layer)
      elif self.slices is not None and x.ref() in self.slices.gathered:
        out = wide  # Gathered for attention: its gradient is scattered.
      elif self.slices is not None and _cast_of(x, self.slices.gathered):
        out = x.op.inputs[0]  # Keras's cast of a float32 gather: the gather.
      else:
        out = collectives.f(self.groups, wide, layer)
      self.outputs[key] = (x, out)
    return self.outputs[key][1]

  def f(self, x, layer):
    """`x` for split projections: `collectives.f(x)`, made once per
    tensor; a sequence slice all-gathered instead."""
    if self.slices is not None and self.slices.is_sliced(x):
      return self.slices.for_split_layer(x, layer)
    if self.slices is not None and x.ref() in self.slices.gathered:
      return x
    key = x.ref() if hasattr(x, "ref") else id(x)
    if key not in self.outputs:
      self.outputs[key] = (x, collectives.f(self.groups, x, layer))
    return self.outputs[key][1]

  def g(self, y, layer):
    """The sum of partial results `y`: reduce-scattered along the
    sequence with sequence parallelism, else all-reduced."""
    if self.slices is not None and collectives.current_slot() is not None:
      scattered = self.slices.reduce_scatter(y, layer)
      if scattered is not None:
        return scattered
    return collectives.g(self.groups, y, layer)

  def whole(self, x, layer):
    """`x`, a sequence slice gathered for replicated work."""
    if self.slices is not None and self.slices.is_sliced(x):
      return self.slices.for_replicated(x, layer)
    return x

  def clear(self):
    self.outputs.clear()
    if self.slices is not None:
      self.slices.clear()


def _cast_of(x, gathered):
  """Whether `x` is a cast of a tensor in `gathered` (Keras casting the
  float32 sequence gather of attention's input to the compute dtype)."""
  op = getattr(x, "op", None)
  return (op is not None and op.type == "Cast" and
          op.inputs[0].ref() in gathered)
