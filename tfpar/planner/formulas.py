"""Bytes per device of one layout: the ZeRO, Megatron and pipeline formulas.

Model states (parameters, gradients, optimizer state) of Ψ trainable
elements over N data-parallel replicas with K optimizer slots per weight
(Adam: 2) come from `tfpar.zero.estimate_bytes`:

* `precision="fp32"` (what Keras keeps): 4Ψ parameters, 4Ψ gradients and
  4KΨ slots; ZeRO-1/2 keep 4(K+1)Ψ/N of state (the slots and the weight
  slice they update), ZeRO-2/3 1/N of the gradients, ZeRO-3 1/N of the
  parameters.
* `precision="mixed"` (the ZeRO paper's mixed-precision Adam): 2Ψ fp16
  parameters, 2Ψ fp16 gradients and 4(K+1)Ψ = 12Ψ fp32 state (master
  weights, momentum, variance): 16Ψ per device, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2
  2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N.
* `precision="mixed_float16"` or `"mixed_bfloat16"` (Keras's mixed
  policies): float32 weights, gradients and slots, as `"fp32"` (Keras casts
  each weight to the compute dtype while its layer runs, it keeps no
  half-precision copy); activations in 2 bytes.

With `gradient_accumulation_steps` k >= 2, Keras's optimizer also keeps one
accumulator per trainable weight, of the weight's shape and dtype (4Ψ; 2Ψ
under "mixed"): whole under plain data parallelism and ZeRO-1, 1/N under
ZeRO-2/3 (as tfpar.ZeRO slices them; on the host with offload).

Tensor parallelism of degree t divides the split weights (and their
gradients, slots and accumulators) by t; pipeline parallelism of degree p
leaves each device one stage; expert parallelism of size e divides the
expert weights of MoE layers (and their gradients and slots) by e
(`experts.py`). CPU offload moves the optimizer state to host
memory. Activations: see `activation_bytes`.
"""

import dataclasses

from tfpar.planner import units
from tfpar.zero import estimate as zero_estimate

PRECISIONS = ("fp32", "mixed", "mixed_float16", "mixed_bfloat16")
# Bytes of one activation element.
ACTIVATION_BYTES = {"fp32": 4, "mixed": 2, "mixed_float16": 2,
                    "mixed_bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes on the fullest device of a layout.

  Attributes:
    parameters: model weights.
    gradients: gradients (fp32: transient in Keras, alive during a step).
    optimizer: optimizer state on the device (0 when offloaded).
    activations: tensors kept for the backward pass.
    host: optimizer state (and, under ZeRO-2/3, gradient accumulators)
      offloaded to host memory, per device.
    stage: the pipeline stage of the fullest device.
    accumulators: Keras's gradient accumulators on the device (0 without
      `gradient_accumulation_steps`).
  """
  parameters: int
  gradients: int
  optimizer: int
  activations: int
  host: int = 0
  stage: int = 0
  accumulators: int = 0

  @property
  def total(self):
    """Device bytes: parameters + gradients + optimizer + activations +
    accumulators."""
    return (self.parameters + self.gradients + self.optimizer +
            self.activations + self.accumulators)


def model_states(trainable, non_trainable, layout, precision="fp32",
                 slots_per_weight=2):
  """(parameters, gradients, optimizer, host) bytes of one device.

  Args:
    trainable: trainable elements on the device before ZeRO (after tensor
      and pipeline splitting).
    non_trainable: other weight elements (kept whole, fp32).
    layout: the `Layout` (its data degree and ZeRO stage, offload).
    precision: one of `PRECISIONS`.
    slots_per_weight: K, optimizer slots per weight (Adam 2).

  Example:

  >>> from tfpar.planner import Layout
  >>> from tfpar.planner.formulas import model_states
  >>> model_states(10**6, 0, Layout(data=4, zero=3), "mixed")
  (500000, 500000, 3000000, 0)
  >>> model_states(10**6, 0, Layout(data=4, zero=3), "mixed_bfloat16")
  (1000000, 1000000, 2000000, 0)
  """
  whole = zero_estimate.estimate_bytes(
      trainable, layout.data, layout.zero, slots_per_weight,
      accumulation=True, bytes_per_element=4)
  if precision != "mixed":  # Keras keeps float32 weights in every policy.
    parameters, optimizer = whole.parameters, whole.optimizer
    # The ZeRO gradient partitioning is that of accumulation buffers: whole
    # up to stage 1, 1/N from stage 2 on.
    gradients = whole.gradient_buffers
  else:
    half = zero_estimate.estimate_bytes(
        trainable, layout.data, layout.zero, slots_per_weight,
        accumulation=True, bytes_per_element=2)
    parameters, gradients = half.parameters, half.gradient_buffers
    optimizer = whole.optimizer
    if layout.zero in (None, 3):
      # fp32 master weights; stages 1-2 count their slice in `optimizer`.
      optimizer += whole.parameters
  parameters += 4 * non_trainable
  host = 0
  if layout.offload:
    host, optimizer = optimizer, 0
  return int(parameters), int(gradients), int(optimizer), int(host)


def accumulator_bytes(trainable, layout, precision="fp32",
                      accumulation_steps=None):
  """(device, host) bytes of Keras's gradient accumulators on one device.

  With `gradient_accumulation_steps` k >= 2, Keras's `BaseOptimizer.build`
  adds one "gradient_accumulator" per trainable weight, of the weight's
  shape and dtype (float32 under Keras's policies; the gradients' 2 bytes
  under the ZeRO paper's "mixed"). `tfpar.ZeRO` keeps them whole at stage
  1 and slices them 1/N at stages 2-3 (on the host with offload).

  Args:
    trainable: trainable elements on the device before ZeRO (after tensor
      and pipeline splitting).
    layout: the `Layout`.
    precision: one of `PRECISIONS`.
    accumulation_steps: k; None or 1 for no accumulation.

  Example:

  >>> from tfpar.planner import Layout
  >>> from tfpar.planner.formulas import accumulator_bytes
  >>> accumulator_bytes(10**6, Layout(data=4, zero=1), accumulation_steps=4)
  (4000000, 0)
  >>> accumulator_bytes(10**6, Layout(data=4, zero=2, offload="cpu"),
  ...                   accumulation_steps=4)
  (0, 1000000)
  """
  if not accumulation_steps or accumulation_steps < 2:
    return 0, 0
  buffers = zero_estimate.estimate_bytes(
      trainable, layout.data, layout.zero, 0, accumulation=True,
      bytes_per_element=2 if precision == "mixed" else 4).gradient_buffers
  if layout.offload and layout.zero in (2, 3):
    return 0, int(buffers)
  return int(buffers), 0


def in_flight(layout, stage):
  """Micro-batches whose activations stage `stage` holds at once:
  min(p - stage, m) under 1F1B, m under GPipe, 1 without a pipeline.

  Example:

  >>> from tfpar.planner import Layout
  >>> from tfpar.planner.formulas import in_flight
  >>> in_flight(Layout(pipeline=4, num_microbatches=16), 0)
  4
  """
  if layout.pipeline == 1:
    return 1
  if layout.schedule == "gpipe":
    return layout.microbatches
  return min(layout.pipeline - stage, layout.microbatches)


def activation_bytes(kept, inputs, layout, stage, batch_size, precision):
  """Activation bytes one device of `stage` holds.

  Each micro-batch in flight keeps `kept` elements per sample (the stage
  input and every layer output, split ones divided by t). With recompute
  the micro-batches in flight keep only their stage `inputs`, except the
  one whose backward runs: it is recomputed whole, so the peak is
  `inputs * (in_flight - 1) + kept`.

  Args:
    kept: elements per sample kept by the stage without recompute.
    inputs: elements per sample of the stage input.
    layout: the `Layout`.
    stage: the stage index.
    batch_size: the global batch.
    precision: "fp32" (4 bytes per element), "mixed" or a Keras mixed
      policy (2).

  Example:

  >>> from tfpar.planner import Layout
  >>> from tfpar.planner.formulas import activation_bytes
  >>> activation_bytes(100, 10, Layout(data=2), 0, 8, "fp32")
  1600
  """
  samples = batch_size / layout.data / layout.microbatches
  element = ACTIVATION_BYTES[precision]
  alive = in_flight(layout, stage)
  if layout.recompute:
    return int(round((inputs * (alive - 1) + kept) * samples * element))
  return int(round(kept * alive * samples * element))
