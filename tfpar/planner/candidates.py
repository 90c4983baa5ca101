"""Candidate layouts for a device count, and their expected speed order.

Every factorization `devices = data x pipeline x tensor` with the tensor
degree inside a node (the seeds: "Never use TP across nodes"), each with
the variants that make sense:

* data parallelism alone: plain, ZeRO-1, ZeRO-2, ZeRO-3, and ZeRO-2 / 3
  with the optimizer state offloaded to the host;
* with tensor or pipeline parallelism: plain and ZeRO-1 over the data axis
  (Megatron's distributed optimizer); pipelines also with recompute;
* for mixture-of-experts models, expert parallelism over the data axis
  (`expert_sizes`: each e > 1 dividing the data size and every MoE
  layer's number of experts).

Speed order (`rank`, lower is faster), from the seeds' strategy comparison
and the ZeRO paper: offload last (host transfers and a CPU optimizer),
then recompute (one more forward), then the model-parallel kind: none,
tensor inside a node, pipeline, both; then smaller tensor and pipeline
degrees; then plain, then expert parallelism (smaller groups first), then
the ZeRO stage (1 and 2 move what data parallelism moves, 3 moves 1.5x).
Expert before ZeRO is the seeds' decision guide: a model that does not
fit one device goes to "Expert + Data Parallelism" when it is sparse
(MoE), to ZeRO and model parallelism when it is dense.
"""

import dataclasses

from tfpar.planner import layout as layout_lib


def divisors(number):
  """The divisors of `number`, ascending.

  Example:

  >>> from tfpar.planner.candidates import divisors
  >>> divisors(12)
  [1, 2, 3, 4, 6, 12]
  """
  return [k for k in range(1, number + 1) if number % k == 0]


def layouts(devices, node_size, max_pipeline=None, num_microbatches=None,
            schedule="1f1b", expert_sizes=()):
  """Every candidate `Layout` for `devices` devices.

  Args:
    devices: N.
    node_size: devices per node; tensor degrees stay at most this.
    max_pipeline: the most stages the model can be cut into (None: any).
    num_microbatches: m for pipelines (None: 4p).
    schedule: "1f1b" or "gpipe".
    expert_sizes: the expert-group sizes e > 1 to add as `DPN + EPe`
      (`experts.expert_sizes`; empty for a dense model).

  Example:

  >>> from tfpar.planner.candidates import layouts
  >>> [l.name for l in layouts(2, 1)][:3]
  ['DP2', 'DP2 + ZeRO-1', 'DP2 + ZeRO-2']
  >>> [l.name for l in layouts(4, 1, expert_sizes=[2, 4])][:4]
  ['DP4', 'DP4 + EP2', 'DP4 + EP4', 'DP4 + ZeRO-1']
  """
  found = []
  for tensor in divisors(devices):
    if tensor > node_size:
      continue
    for pipeline in divisors(devices // tensor):
      if max_pipeline is not None and pipeline > max_pipeline:
        continue
      data = devices // tensor // pipeline
      base = dict(data=data, tensor=tensor, pipeline=pipeline)
      if pipeline > 1:
        base.update(num_microbatches=num_microbatches, schedule=schedule)
      if tensor == pipeline == 1:
        variants = [{}] + [dict(expert=e) for e in expert_sizes]
        if data > 1:
          variants += [dict(zero=1), dict(zero=2), dict(zero=3)]
        variants += [dict(zero=2, offload="cpu"), dict(zero=3, offload="cpu")]
      else:
        variants = [{}] + ([dict(zero=1)] if data > 1 else [])
        if pipeline > 1:
          variants += [dict(v, recompute=True) for v in variants]
      found.extend(layout_lib.Layout(**base, **v) for v in variants)
  return sorted(found, key=rank)


def rank(layout):
  """The expected speed order key of a layout (lower is faster).

  Example:

  >>> from tfpar.planner.candidates import rank
  >>> from tfpar.planner import Layout
  >>> rank(Layout(data=4, zero=3)) < rank(Layout(data=2, tensor=2))
  True
  >>> rank(Layout(data=4)) < rank(Layout(data=4, expert=2)) < rank(
  ...     Layout(data=4, zero=1))
  True
  """
  kind = (layout.tensor > 1) + 2 * (layout.pipeline > 1)
  return (bool(layout.offload), layout.recompute, kind, layout.tensor,
          layout.pipeline, bool(layout.zero), layout.expert, layout.zero or 0)


# Combinations tfpar runs: tensor-parallel pipeline stages (3D) and
# tfpar.ZeRO on top of tensor or pipeline parallelism (tests/test_three_d.py).
# A combination that stops running is marked "not yet" by clearing its flag.
PIPELINE_WITH_TENSOR_RUNS = True
ZERO_WITH_MODEL_PARALLEL_RUNS = True


def supported(layout):
  """(whether tfpar runs the layout today, why not).

  Example:

  >>> from tfpar.planner.candidates import supported
  >>> from tfpar.planner import Layout
  >>> supported(Layout(data=4, zero=3))
  (True, '')
  """
  if (layout.tensor > 1 and layout.pipeline > 1 and
      not PIPELINE_WITH_TENSOR_RUNS):
    return False, "pipeline and tensor parallelism do not combine yet"
  if (layout.zero and (layout.tensor > 1 or layout.pipeline > 1) and
      not ZERO_WITH_MODEL_PARALLEL_RUNS):
    return False, ("tfpar.ZeRO runs under data parallelism only, not with "
                   "tensor or pipeline parallelism yet")
  return True, ""


def how_to_run(layout):
  """The tfpar code for a layout, or "" when tfpar cannot run it.

  Example:

  >>> from tfpar.planner.candidates import how_to_run
  >>> from tfpar.planner import Layout
  >>> print(how_to_run(Layout(data=8, zero=2)))
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 8})); model.fit(..., callbacks=[tfpar.ZeRO(stage=2)])
  >>> print(how_to_run(Layout(data=8, expert=4)))
  strategy = tfpar.ExpertParallelStrategy(tfpar.Mesh({"data": 8}), expert=4)
  """
  if not supported(layout)[0]:
    return ""
  axes = [f'"data": {layout.data}']
  if layout.pipeline > 1:
    axes.append(f'"pipeline": {layout.pipeline}')
  if layout.tensor > 1:
    axes.append(f'"tensor": {layout.tensor}')
  mesh = "tfpar.Mesh({" + ", ".join(axes) + "})"
  if layout.pipeline > 1:
    extra = (f', schedule="{layout.schedule}"'
             if layout.schedule != "1f1b" else "")
    extra += ", recompute=True" if layout.recompute else ""
    code = (f"strategy = tfpar.PipelineParallelStrategy({mesh}, "
            f"num_microbatches={layout.microbatches}{extra})")
  elif layout.tensor > 1:
    code = f"strategy = tfpar.TensorParallelStrategy({mesh})"
  elif layout.expert > 1:
    return (f"strategy = tfpar.ExpertParallelStrategy({mesh}, "
            f"expert={layout.expert})")
  elif layout.zero == 3:  # Weights created sliced (one node; build_peak).
    offload = ', offload="cpu"' if layout.offload else ""
    return (f"strategy = tfpar.DataParallelStrategy({mesh}, "
            f"zero=tfpar.ZeRO(stage=3{offload}))")
  else:
    code = f"strategy = tfpar.DataParallelStrategy({mesh})"
  if layout.zero:
    offload = ', offload="cpu"' if layout.offload else ""
    code += (f"; model.fit(..., callbacks=[tfpar.ZeRO(stage={layout.zero}"
             f"{offload})])")
  return code


@dataclasses.dataclass(frozen=True)
class Rule:
  """A rule of the seeds' decision guide or best practices.

  Attributes:
    text: the rule as the seed states it.
    source: where it comes from.
  """
  text: str
  source: str

  def __str__(self):
    return f'"{self.text}" ({self.source})'


FITS_ONE_DEVICE = Rule("Does your model fit on a single GPU? Yes -> Data "
                       "Parallelism", "seeds' decision guide")
MEMORY_LIMITED = Rule("Memory limited -> ZeRO / Offloading",
                      "seeds' decision guide")
ZERO3_COMMUNICATION = Rule(
    "ZeRO-3 requires all-gather for every forward pass, adding ~50% "
    "communication overhead", "seeds' ZeRO communication tradeoff")
SPARSE_MODEL = Rule("No -> sparse (MoE) model: Expert + Data Parallelism; "
                    "Sparse/MoE -> Expert Parallelism",
                    "seeds' decision guide")
LARGE_MODEL = Rule("No -> dense model: Tensor + Pipeline + ZeRO; Large model "
                   "-> Model/Tensor/Pipeline", "seeds' decision guide")
INTERCONNECT = Rule("Use TP within nodes (NVLink), PP across nodes "
                    "(InfiniBand), and DP anywhere", "seeds' best practices")
MICROBATCHES = Rule("use at least 4x as many micro-batches as stages",
                    "seeds' best practices")
RECOMPUTE = Rule("Enable Gradient Checkpointing: Trade compute for memory by "
                 "recomputing activations during backward pass",
                 "seeds' best practices")


def rules_for(layout):
  """The seed rules that lead to `layout`.

  Example:

  >>> from tfpar.planner.candidates import rules_for
  >>> from tfpar.planner import Layout
  >>> rules_for(Layout(data=4))[0].source
  "seeds' decision guide"
  >>> print(rules_for(Layout(data=4, expert=2))[0])
  "No -> sparse (MoE) model: Expert + Data Parallelism; Sparse/MoE -> Expert Parallelism" (seeds' decision guide)
  """
  if layout.expert > 1:
    return [SPARSE_MODEL]
  if layout.tensor == layout.pipeline == 1:
    if not layout.zero:
      return [FITS_ONE_DEVICE]
    return [MEMORY_LIMITED] + ([ZERO3_COMMUNICATION] if layout.zero == 3
                               else [])
  found = [LARGE_MODEL, INTERCONNECT]
  if layout.pipeline > 1:
    found.append(MICROBATCHES)
  if layout.recompute:
    found.append(RECOMPUTE)
  if layout.zero:
    found.append(MEMORY_LIMITED)
  return found
