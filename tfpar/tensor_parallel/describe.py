"""The table `ShardingPlan.describe` prints."""

from tfpar.common import strategy_hooks
from tfpar.engine import training_summary
from tfpar.tensor_parallel import coverage as coverage_lib
from tfpar.tensor_parallel import styles


def _short(device, multi_worker=False):
  """CPU:1, or task:1/CPU:1 when the mesh spans several workers."""
  spec = device.split("/")
  name = device.split("device:")[-1] if "device:" in device else device
  task = [p for p in spec if p.startswith("task:")]
  return f"{task[0]}/{name}" if multi_worker and task else name


def describe(plan, model, strategy):
  """One line per variable: path, full shape, style, shard shape, devices;
  then the coverage, the mesh, and the dtype policy and accumulation.

  Args:
    plan: the `ShardingPlan`.
    model: a built Keras model (sharded or not).
    strategy: the `TensorParallelStrategy` (or a `PipelineParallelStrategy`
      with a tensor axis, whose stage s uses the replica's devices
      s*tensor .. s*tensor+tensor-1), or None for the model's own.

  Returns:
    The table as a string.
  """
  if strategy is None:
    strategy = model.distribute_strategy
  mesh = getattr(strategy, "mesh", None)
  if mesh is None or "tensor" not in mesh.shape:
    raise ValueError(
        f"describe needs a tfpar.TensorParallelStrategy; model {model.name!r} "
        f"has {strategy!r}. Pass strategy=.")
  tensor_size = mesh.shape["tensor"]
  # Weights another parallelism splits (experts under expert x tensor):
  # {path: (style, shard shape, devices)}.
  elsewhere = strategy_hooks.of(strategy).describe_elsewhere(model)
  layer_layouts = getattr(model, "_tfpar_layouts", None)
  if layer_layouts is None:
    layer_layouts = plan.resolve(model, tensor_size, elsewhere)
  by_path = {v.path: v for layout in layer_layouts for v in layout.variables}
  groups = mesh.replicas
  multi = mesh.is_multi_worker
  stage_of = _stage_of_layer(model, strategy)
  rows = [("variable", "full shape", "style", "shard shape", "devices")]
  from tfpar.common import split_weights  # pylint: disable=g-import-not-at-top
  paths = list(split_weights.logical_weights_paths(model))
  for path, shape in paths:
    if path in elsewhere:
      rows.append((path, str(tuple(shape))) + tuple(elsewhere[path]))
      continue
    layout = by_path.get(path)
    # Stages s, s + p, ... share a device (interleaved).
    first = (stage_of.get(path.split("/")[0], 0) % mesh.shape["pipeline"]
             ) * tensor_size
    if layout is None or layout.axis is None:
      style = layout.style if layout is not None else styles.REPLICATE
      if not isinstance(style, styles.Replicate):
        style = f"{style} (replicated)"
      devices = ",".join(
          _short(d, multi) for g in groups
          for d in g[first:first + tensor_size])  # Every device of its group.
      rows.append((path, str(tuple(shape)), str(style), str(tuple(shape)),
                   devices))
      continue
    devices = " | ".join(
        f"{k}: " + ",".join(_short(g[first + k], multi) for g in groups)
        for k in range(tensor_size))
    rows.append((path, str(layout.shape), f"{layout.style} axis {layout.axis}",
                 str(layout.shard_shape(tensor_size)), devices))
  widths = [max(len(r[i]) for r in rows) for i in range(5)]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
           for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  lines.append(coverage_lib.coverage(paths, layer_layouts,
                                     elsewhere).summary())
  if stage_of:
    lines.append(
        f"mesh: data={mesh.shape['data']} pipeline={mesh.shape['pipeline']} "
        f"tensor={tensor_size}; in replica r, stage s holds shard k on the "
        f"replica's device s*{tensor_size}+k")
  else:
    lines.append(f"mesh: data={mesh.shape['data']} tensor={tensor_size}; "
                 f"replica r holds shard k on the k-th device of its group"
                 + "; replicated weights on every device")
  lines.append(training_summary.training_line(model))
  return "\n".join(lines)


def _stage_of_layer(model, strategy):
  """{top-level layer name: its pipeline stage}; {} without a pipeline."""
  stage_plan = getattr(model, "_tfpar_stage_plan", None)
  if stage_plan is None:
    stage_plan = strategy_hooks.of(strategy).stage_plan(model)
  if stage_plan is None:
    return {}
  return {layer.name: stage.index for stage in stage_plan.stages
          for layer in stage.layers}
