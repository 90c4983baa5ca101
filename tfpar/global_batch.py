"""The global batch kept when a job runs on another number of replicas.

An elastic job (`tfpar launch --elastic`) or a resume on other machines
runs on another number of data replicas than the run that made its
backup. Training goes on as before only if every optimizer update still
averages the same number of examples (the global batch): then, on the
same data in the same order, the updates are those of the uninterrupted
run. `keep_global_batch` says what to pass `fit` and the optimizer for
that, adjusting the per-replica batch or the gradient accumulation (the
user's choice), and refuses, naming the numbers, what cannot keep it.

No TensorFlow here.
"""

import dataclasses

_ADJUSTS = ("per_replica_batch", "gradient_accumulation_steps")


@dataclasses.dataclass(frozen=True)
class GlobalBatchPlan:
  """What keeps a global batch on some number of replicas.

  Attributes:
    global_batch: examples per optimizer update, over every replica.
    replicas: the number of data replicas.
    per_replica_batch: examples per replica per step.
    accumulation: steps whose gradients make one update (1: none).
  """

  global_batch: int
  replicas: int
  per_replica_batch: int
  accumulation: int

  @property
  def batch_size(self):
    """The `batch_size` to pass `fit` (examples per step, all replicas)."""
    return self.per_replica_batch * self.replicas

  @property
  def gradient_accumulation_steps(self):
    """The optimizer's `gradient_accumulation_steps` (None: none, as Keras
    takes only values of 2 or more)."""
    return self.accumulation if self.accumulation > 1 else None


def _replicas(strategy_or_replicas):
  if isinstance(strategy_or_replicas, int):
    return strategy_or_replicas
  return strategy_or_replicas.num_replicas_in_sync


def keep_global_batch(strategy, global_batch, adjust="per_replica_batch",
                      per_replica_batch=None, log=print):
  """The batch and accumulation that keep `global_batch` on `strategy`.

  Args:
    strategy: the strategy (its `num_replicas_in_sync` data replicas), or
      the number of replicas.
    global_batch: examples per optimizer update, the same on every number
      of replicas.
    adjust: "per_replica_batch" (each replica takes
      `global_batch / replicas` examples a step, no accumulation) or
      "gradient_accumulation_steps" (each replica takes `per_replica_batch`
      examples a step, and `global_batch / (per_replica_batch x replicas)`
      steps make an update).
    per_replica_batch: with adjust="gradient_accumulation_steps", the
      examples a replica takes per step (what fits its memory).
    log: called with the line that states the choice (None: silent).

  Returns:
    A `GlobalBatchPlan`: pass `plan.batch_size` to `fit` and
    `plan.gradient_accumulation_steps` to the optimizer.

  Raises:
    ValueError: when the global batch cannot be kept on that many
      replicas, naming the numbers, before any work.

  Example:

  >>> plan = keep_global_batch(4, 24)
  tfpar: global batch 24 kept on 4 replicas: per-replica batch 6 (adjusted), no gradient accumulation
  >>> plan.batch_size, plan.gradient_accumulation_steps
  (24, None)
  >>> plan = keep_global_batch(2, 24, "gradient_accumulation_steps",
  ...                          per_replica_batch=6, log=None)
  >>> plan.batch_size, plan.gradient_accumulation_steps
  (12, 2)
  """
  replicas = _replicas(strategy)
  for name, value in (("global_batch", global_batch),
                      ("replicas", replicas)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"keep_global_batch: {name} must be a positive "
                       f"integer. Received: {name}={value!r}")
  if adjust not in _ADJUSTS:
    raise ValueError(f"keep_global_batch: adjust must be one of "
                     f"{list(_ADJUSTS)}. Received: adjust={adjust!r}")
  if adjust == "per_replica_batch":
    if global_batch % replicas:
      raise ValueError(
          f"The global batch {global_batch} cannot be kept on {replicas} "
          f"replicas by adjusting the per-replica batch: {global_batch} is "
          f"not a multiple of {replicas}. Run on a number of replicas that "
          f"divides {global_batch}, or pass adjust="
          f"'gradient_accumulation_steps' with a per_replica_batch.")
    plan = GlobalBatchPlan(global_batch, replicas, global_batch // replicas,
                           1)
    what = (f"per-replica batch {plan.per_replica_batch} (adjusted), no "
            "gradient accumulation")
  else:
    if not isinstance(per_replica_batch, int) or per_replica_batch < 1:
      raise ValueError(
          f"keep_global_batch: adjust='gradient_accumulation_steps' needs "
          f"per_replica_batch, a positive integer. Received: "
          f"per_replica_batch={per_replica_batch!r}")
    step = per_replica_batch * replicas
    if global_batch % step:
      raise ValueError(
          f"The global batch {global_batch} cannot be kept on {replicas} "
          f"replicas with a per-replica batch of {per_replica_batch} by "
          f"accumulating gradients: a step takes {step} examples, and "
          f"{global_batch} is not a multiple of {step}.")
    plan = GlobalBatchPlan(global_batch, replicas, per_replica_batch,
                           global_batch // step)
    what = (f"per-replica batch {per_replica_batch}, "
            f"gradient_accumulation_steps {plan.accumulation} (adjusted)")
  if log is not None:
    log(f"tfpar: global batch {global_batch} kept on {replicas} replicas: "
        f"{what}")
  return plan
