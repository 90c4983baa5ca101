"""`tfpar.plan`: memory per device of every layout, and a recommendation."""

import dataclasses
import numbers

from tfpar.planner import build_peak
from tfpar.planner import candidates as candidates_lib
from tfpar.planner import experts
from tfpar.planner import formulas
from tfpar.planner import layout as layout_lib
from tfpar.planner import profile as profile_lib
from tfpar.planner import recommend as recommend_lib
from tfpar.planner import result as result_lib
from tfpar.planner import units
from tfpar.planner.optimizer_state import accumulation_steps
from tfpar.planner.optimizer_state import optimizer_slots


def plan(model, devices, memory_per_device, batch_size=None,
         precision="fp32", optimizer=None, node_size=None,
         num_microbatches=None, schedule="1f1b", sharding_plan=None,
         gradient_accumulation_steps=None):
  """Memory per device of every layout of `model` on `devices` devices.

  For each candidate layout (data parallelism, ZeRO 1/2/3, CPU offload,
  tensor parallelism inside a node, pipelines with and without recompute,
  their combinations, and for mixture-of-experts models expert
  parallelism) estimates the parameters, gradients, optimizer state and
  activations of its fullest device, from the model's real variables, the
  layers tensor parallelism splits, the stages pipeline parallelism cuts,
  the expert weights expert parallelism splits and the layers' output
  shapes. Recommends the fastest layout that fits, following the seeds'
  decision guide (a sparse / MoE model that does not fit one device goes
  to expert + data parallelism before ZeRO).

  Args:
    model: a built Keras model, or a parameter count for a model-free
      estimate of the model states (e.g. `7.5e9`).
    devices: N, the number of devices.
    memory_per_device: bytes, or a size such as "16GB" or "40GiB".
    batch_size: the global batch (default: N, one sample per device).
    precision: "fp32" (Keras's float32 weights, gradients and slots),
      "mixed" (the ZeRO paper's fp16 weights and gradients with fp32 Adam
      state and fp16 activations), or a Keras policy, "mixed_float16" or
      "mixed_bfloat16" (float32 weights, gradients and slots, activations
      in 2 bytes).
    optimizer: a Keras optimizer, its name, or slots per weight as an int;
      default: the model's compiled optimizer, else Adam (2 slots).
    node_size: devices per node, the largest tensor degree (default:
      min(N, 8)).
    num_microbatches: m for pipelines (default 4p, capped at the samples a
      replica gets).
    schedule: "1f1b" or "gpipe".
    sharding_plan: the `tfpar.ShardingPlan` for tensor parallelism
      (default: the built-in plan).
    gradient_accumulation_steps: k, the optimizer's
      `gradient_accumulation_steps` (1 for none); counts Keras's gradient
      accumulators. Default: the optimizer's own setting.

  Returns:
    A `PlanResult`: print it for the table; `.recommended`, `.reason`,
    `.plot(path)`.

  Raises:
    ValueError: a bad setting; the message names it, its value and the
      rule.

  Example:

  >>> import tfpar.planner
  >>> result = tfpar.planner.plan(7.5e9, devices=64, memory_per_device="32GB",
  ...                             precision="mixed")
  >>> [f"{c.memory.total / 1e9:.3g}" for c in result.shown()[:4]]
  ['120', '31.4', '16.6', '1.88']
  """
  devices = units.check_positive_int(devices, "devices")
  limit = units.parse_bytes(memory_per_device, "memory_per_device")
  units.check_choice(precision, "precision", formulas.PRECISIONS)
  units.check_choice(schedule, "schedule", layout_lib.SCHEDULES)
  batch = units.check_positive_int(devices if batch_size is None
                                   else batch_size, "batch_size")
  node_size = units.check_positive_int(
      min(devices, 8) if node_size is None else node_size, "node_size")
  if num_microbatches is not None:
    units.check_positive_int(num_microbatches, "num_microbatches")
  profile = _profile(model, sharding_plan)
  optimizer = (optimizer if optimizer is not None
               else getattr(model, "optimizer", None))
  slots = optimizer_slots(optimizer)
  steps = accumulation_steps(gradient_accumulation_steps, optimizer)
  expert_sizes, notes = experts.expert_sizes(devices, profile.moe), []
  found, skipped = [], {}
  for layout in candidates_lib.layouts(devices, node_size,
                                       profile.max_pipeline,
                                       num_microbatches, schedule,
                                       expert_sizes):
    if layout.recompute and not profile.has_activations:
      continue  # Recompute changes activations only.
    if layout.data > batch:
      skipped.setdefault(
          ("batch", layout.data),
          f"{layout.data} replicas need a global batch of at least "
          f"{layout.data}; batch_size={batch}.")
      continue
    if layout.pipeline > 1 and num_microbatches is None:
      layout = dataclasses.replace(layout, num_microbatches=max(1, min(
          4 * layout.pipeline, batch // layout.data)))
    try:
      loads = profile.stages(layout.tensor, layout.pipeline)
    except ValueError as error:
      skipped.setdefault((layout.tensor, layout.pipeline),
                         f"TP{layout.tensor} x PP{layout.pipeline}: {error}")
      continue
    found.append(_candidate(layout, loads, profile, limit, batch, precision,
                            slots, steps, node_size))
  if not found:
    raise ValueError(
        f"No layout of {devices} devices applies to {profile.name!r}: "
        + " ".join(skipped.values()))
  notes.extend(skipped.values())
  notes.extend(_assumptions(profile, devices, node_size, precision))
  recommended, reason = recommend_lib.recommend(found, limit, devices)
  return result_lib.PlanResult(
      profile.name, devices, limit, precision, batch, slots, tuple(found),
      recommended, reason, tuple(notes), profile.has_activations, steps)


def estimate_layout(model, layout, precision="fp32", optimizer=None,
                    batch_size=None, sharding_plan=None,
                    gradient_accumulation_steps=None):
  """Bytes on the fullest device of one layout.

  With a parameter count: the ZeRO paper's formulas for the model states
  (tensor parallelism taken to split every weight, pipeline stages equal,
  activations 0). With a Keras model: its real variables, split weights,
  stages and layer outputs, as `plan` uses them.

  Args:
    model: a parameter count Ψ, or a built Keras model.
    layout: a `tfpar.planner.Layout`.
    precision: as for `plan`.
    optimizer: a Keras optimizer, its name, or slots per weight (default:
      the model's compiled optimizer, else Adam's 2).
    batch_size: the global batch (default: the layout's device count).
    sharding_plan: the `tfpar.ShardingPlan` for tensor parallelism.
    gradient_accumulation_steps: as for `plan`.

  Returns:
    A `MemoryEstimate` (its `stage` is the fullest device's stage).

  Raises:
    ValueError: a bad setting, or a layout the model cannot take.

  Example:

  >>> from tfpar.planner import Layout, estimate_layout
  >>> estimate = estimate_layout(7.5e9, Layout(data=64, zero=1), "mixed")
  >>> f"{estimate.total / 1e9:.3g} GB"
  '31.4 GB'
  """
  units.check_choice(precision, "precision", formulas.PRECISIONS)
  if not isinstance(layout, layout_lib.Layout):
    raise ValueError(f"layout must be a tfpar.planner.Layout. Received: "
                     f"layout={layout!r}.")
  batch = units.check_positive_int(
      layout.devices if batch_size is None else batch_size, "batch_size")
  profile = _profile(model, sharding_plan)
  optimizer = (optimizer if optimizer is not None
               else getattr(model, "optimizer", None))
  slots = optimizer_slots(optimizer)
  steps = accumulation_steps(gradient_accumulation_steps, optimizer)
  loads = experts.split_loads(profile.stages(layout.tensor, layout.pipeline),
                              profile.moe, layout.expert)
  return _fullest(layout, loads, profile, batch, precision, slots, steps)


def _profile(model, sharding_plan):
  if isinstance(model, numbers.Real) and not isinstance(model, bool):
    if model < 1:
      raise ValueError(f"model as a parameter count must be at least 1. "
                       f"Received: model={model!r}.")
    return profile_lib.CountProfile(model)
  import keras  # pylint: disable=g-import-not-at-top
  if not isinstance(model, keras.Model):
    raise ValueError(
        f"model must be a built Keras model or a parameter count such as "
        f"7.5e9. Received: model={model!r}.")
  return profile_lib.KerasProfile(model, sharding_plan)


def _candidate(layout, loads, profile, limit, batch, precision, slots,
               steps, node_size):
  best = _fullest(layout, experts.split_loads(loads, profile.moe,
                                              layout.expert),
                  profile, batch, precision, slots, steps)
  runs, why = candidates_lib.supported(layout)
  # A layout fits only if the model can also be built in it.
  if layout.expert > 1:
    build = experts.build_bytes(loads, profile.moe, layout.expert, precision)
  else:
    build = build_peak.build_peak_bytes(layout, loads, profile, precision,
                                        node_size)
  return result_lib.Candidate(layout, best, best.total <= limit and
                              build <= limit, runs, why,
                              candidates_lib.rank(layout), build)


def _fullest(layout, loads, profile, batch, precision, slots, steps=None):
  """The `MemoryEstimate` of the stage with the most bytes."""
  best = None
  for stage, load in enumerate(loads):
    parameters, gradients, optimizer, host = formulas.model_states(
        load.trainable, load.non_trainable, layout, precision, slots)
    accumulators, host_accumulators = formulas.accumulator_bytes(
        load.trainable, layout, precision, steps)
    activations = (formulas.activation_bytes(
        load.kept, load.inputs, layout, stage, batch, precision)
                   if profile.has_activations else 0)
    memory = formulas.MemoryEstimate(parameters, gradients, optimizer,
                                     activations, host + host_accumulators,
                                     stage, accumulators)
    if best is None or memory.total > best.total:
      best = memory
  return best


def _assumptions(profile, devices, node_size, precision):
  notes = []
  if isinstance(profile, profile_lib.CountProfile):
    notes.append(
        "Activations are not estimated without a model (model states only); "
        "tensor parallelism is assumed to split every weight and pipeline "
        "stages to be equal.")
  elif not profile.has_activations:
    notes.append(
        f"Activations are not estimated: {profile.name!r} is not a "
        f"Sequential or Functional model, so its layer outputs (and "
        f"pipeline stages) are unknown.")
  if getattr(profile, "unknown_shapes", None):
    notes.append(
        f"Some layer outputs have unknown dimensions (counted as 1): "
        f"{sorted(profile.unknown_shapes)[:3]}. Build the model with full "
        f"shapes for activation estimates.")
  if devices > node_size:
    notes.append(
        f"Tensor degrees above node_size={node_size} are left out: "
        f"{candidates_lib.INTERCONNECT}.")
  if precision == "mixed" and not isinstance(profile,
                                             profile_lib.CountProfile):
    notes.append(
        "precision='mixed' is the ZeRO paper's accounting (fp16 weights and "
        "gradients, fp32 master weights in the optimizer state). Keras's "
        "mixed policies keep float32 weights: for them use "
        "precision='mixed_float16' or 'mixed_bfloat16'.")
  notes.extend(experts.notes(profile.moe))
  notes.append(
      "Estimates leave out temporary buffers, the framework's workspace and "
      "fragmentation; keep some headroom.")
  return notes

