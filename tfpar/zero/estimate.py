"""ZeRO's memory formulas: bytes per device before anything runs."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ZeroEstimate:
  """Bytes per device that `tfpar.ZeRO` keeps between steps.

  Attributes:
    parameters: model weights.
    optimizer: optimizer slots, plus the weight slice stages 1-2 update.
    gradient_buffers: gradient accumulation buffers (0 without
      `gradient_accumulation_steps`).
  """
  parameters: int
  optimizer: int
  gradient_buffers: int

  @property
  def total(self):
    return self.parameters + self.optimizer + self.gradient_buffers


def estimate_bytes(num_parameters, replicas, stage=None, slots_per_weight=2,
                   accumulation=False, bytes_per_element=4):
  """Bytes per device under ZeRO, from the ZeRO paper's formulas.

  With Ψ parameters, N replicas and K optimizer slots per weight (Adam:
  2), per device: stage None (plain data parallelism) keeps 4Ψ of weights
  and 4KΨ of state; stage 1 and 2 keep 4(K+1)Ψ/N of state (the slots and
  the weight slice they update); stage 3 keeps 4Ψ/N of weights and 4KΨ/N
  of state. Accumulation buffers are 4Ψ, or 4Ψ/N from stage 2 on. Slices
  are padded to whole elements, so `tfpar.memory_report` may exceed this
  by up to N - 1 elements per weight.

  Args:
    num_parameters: Ψ, trainable elements of the model.
    replicas: N, the data-parallel replica count.
    stage: None, 1, 2 or 3.
    slots_per_weight: K (SGD with momentum 1, Adam 2, plain SGD 0).
    accumulation: whether `gradient_accumulation_steps` is set.
    bytes_per_element: 4 for float32.

  Returns:
    A `ZeroEstimate`.

  Raises:
    ValueError: an unknown stage or a replica count below 1.

  Example:

  >>> import tfpar
  >>> tfpar.zero.estimate_bytes(1_000_000, 4, stage=2).optimizer
  3000000
  """
  if stage not in (None, 1, 2, 3):
    raise ValueError(f"stage must be None, 1, 2 or 3. Received: {stage!r}.")
  if replicas < 1:
    raise ValueError(f"replicas must be at least 1. Received: {replicas!r}.")
  whole = num_parameters * bytes_per_element
  sliced = whole // replicas
  if stage is None:
    parameters, optimizer = whole, slots_per_weight * whole
  elif stage < 3:
    parameters, optimizer = whole, (slots_per_weight + 1) * sliced
  else:
    parameters, optimizer = sliced, slots_per_weight * sliced
  buffers = 0
  if accumulation:
    buffers = whole if stage in (None, 1) else sliced
  return ZeroEstimate(parameters, optimizer, buffers)
