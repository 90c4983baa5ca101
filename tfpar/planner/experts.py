"""Mixture-of-experts models in the planner: what expert parallelism splits.

`tfpar.ExpertParallelStrategy(mesh, expert=e)` splits each MoE layer's
expert weights [E, ...] over groups of e data replicas, so a device keeps
E/e experts of every MoE layer (their gradients and optimizer slots as
well); everything else (embeddings, attention, norms, routers, shared
experts) is data-parallel. The MoE layers are the ones
`tfpar.expert_parallel.families` recognises (e.g. keras-hub's Mixtral and
Qwen-MoE blocks), found by its `moe_blocks`.

Weights are built whole on every replica and split afterwards
(`tfpar/expert_parallel/variables.py`), so while a model is built a device
holds the whole weights and one expert weight in transit (`build_bytes`).
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class MoeFacts:
  """The expert weights of a model.

  Attributes:
    num_experts: E of each MoE layer, in layer order.
    trainable: trainable elements of every expert weight, whole.
    non_trainable: other elements of expert weights, whole.
    largest: elements of the largest expert weight, whole.
  """
  num_experts: tuple
  trainable: int
  non_trainable: int
  largest: int


def moe_facts(model):
  """The `MoeFacts` of a Keras model, or None when it has no MoE layer.

  Args:
    model: a built Keras model (not split by a strategy).

  Example:

  >>> import keras
  >>> moe_facts(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
  """
  from tfpar.expert_parallel import families  # pylint: disable=g-import-not-at-top
  blocks = families.moe_blocks(model)
  if not blocks:
    return None
  trainable = non_trainable = largest = 0
  for block, family in blocks:
    for name in family.expert_weight_names:
      variable = getattr(family.bank, name)
      size = math.prod(int(d) for d in variable.shape)
      largest = max(largest, size)
      if variable.trainable:
        trainable += size
      else:
        non_trainable += size
  return MoeFacts(tuple(int(block.num_experts) for block, _ in blocks),
                  trainable, non_trainable, largest)


def expert_sizes(data, facts):
  """The expert sizes e > 1 worth planning: e divides the data size and
  every MoE layer's number of experts.

  Args:
    data: the data size d.
    facts: the model's `MoeFacts`, or None.

  Example:

  >>> expert_sizes(8, MoeFacts((4, 4), 1000, 0, 500))
  [2, 4]
  >>> expert_sizes(8, None)
  []
  """
  if facts is None:
    return []
  return [e for e in range(2, data + 1) if data % e == 0 and
          all(n % e == 0 for n in facts.num_experts)]


def split_loads(loads, facts, expert):
  """The `StageLoad`s of one device when the experts are split e ways.

  Args:
    loads: the data-parallel `StageLoad`s (one stage, whole weights).
    facts: the model's `MoeFacts` (None: the model has no MoE layer).
    expert: e; 1 returns `loads` unchanged.

  Raises:
    ValueError: e > 1 for a model without MoE layers, or e does not divide
      the experts of every MoE layer.

  Example:

  >>> from tfpar.planner.profile import StageLoad
  >>> split_loads([StageLoad(1000)], MoeFacts((4,), 800, 0, 400), 4)
  [StageLoad(trainable=400, non_trainable=0, kept=0.0, inputs=0.0)]
  """
  if expert == 1:
    return loads
  if facts is None:
    raise ValueError(
        f"expert={expert} needs a model with mixture-of-experts layers "
        f"(keras-hub's Mixtral or Qwen-MoE blocks); this model has none, or "
        f"was given as a parameter count.")
  uneven = [n for n in facts.num_experts if n % expert]
  if uneven:
    raise ValueError(
        f"expert={expert} must divide every MoE layer's number of experts, "
        f"but a layer has {uneven[0]}. Received: expert={expert}.")
  return [dataclasses.replace(
      load,
      trainable=load.trainable - facts.trainable + facts.trainable // expert,
      non_trainable=(load.non_trainable - facts.non_trainable +
                     facts.non_trainable // expert))
          for load in loads]


def build_bytes(loads, facts, expert, precision):
  """Weight bytes on a device while an expert-parallel model is built.

  Every replica builds the whole model; then each expert weight is split
  and its whole variable freed, one at a time (measured in
  tests/test_expert_plan_recipe.py): the whole weights plus one expert
  weight in transit.

  Args:
    loads: the data-parallel `StageLoad`s (whole weights).
    facts: the model's `MoeFacts`.
    expert: e (the build peak does not depend on it).
    precision: "mixed" counts 2-byte weights (the ZeRO paper's), else 4.

  Example:

  >>> from tfpar.planner.profile import StageLoad
  >>> build_bytes([StageLoad(1000)], MoeFacts((4,), 800, 0, 400), 4, "fp32")
  5600
  """
  del expert
  per_element = 2 if precision == "mixed" else 4
  load = loads[0]
  whole = per_element * load.trainable + 4 * load.non_trainable
  return whole + per_element * facts.largest


def notes(facts):
  """What the expert-parallel estimates assume, for a model with experts.

  Example:

  >>> notes(None)
  []
  >>> notes(MoeFacts((4, 4), 1000, 0, 500))[0][:58]
  'Expert layouts (+ EPe): 2 MoE layers with 4 experts each; '
  """
  if facts is None:
    return []
  counts = sorted(set(facts.num_experts))
  experts_text = (f"{counts[0]} experts each" if len(counts) == 1 else
                  f"{', '.join(map(str, facts.num_experts))} experts")
  return [
      f"Expert layouts (+ EPe): {len(facts.num_experts)} MoE layers with "
      f"{experts_text}; {facts.trainable + facts.non_trainable:,} expert "
      f"weight elements, whose weights, gradients and optimizer slots are "
      f"divided by e; the rest as data parallelism. Each replica builds the "
      f"whole model before its experts are split (the build column). "
      f"Activations are data parallelism's: the all-to-all dispatch buffers "
      f"(E x C x hidden per MoE layer and replica) are not counted."]
