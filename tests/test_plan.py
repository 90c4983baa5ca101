"""Tests of the memory planner: `tfpar.planner.plan` and `tfpar plan`."""

import argparse
import re

import numpy as np
import pytest
import tensorflow as tf

import dp_common
import pp_common
import tfpar
import tp_common
from tfpar import planner
from tfpar.planner import chart
from tfpar.planner import cli as planner_cli
from tfpar.planner import Layout

# ZeRO paper (arXiv 1910.02054) Table 1, Ψ = 7.5B, N = 64, mixed-precision
# Adam, in GB of 10**9 bytes: baseline, P_os, P_os+g, P_os+g+p.
PAPER_TABLE_1 = {None: "120", 1: "31.4", 2: "16.6", 3: "1.88"}


@pytest.mark.parametrize("stage", [None, 1, 2, 3])
def test_zero_paper_table_1_row(stage):
  estimate = planner.estimate_layout(7.5e9, Layout(data=64, zero=stage),
                                     precision="mixed")
  assert f"{estimate.total / 1e9:.3g}" == PAPER_TABLE_1[stage]
  # The paper's split: 2Ψ fp16 weights, 2Ψ fp16 gradients, 12Ψ fp32 state,
  # the sharded ones divided by N.
  psi, n = 7.5e9, 64
  assert estimate.parameters == pytest.approx(2 * psi / (n if stage == 3
                                                         else 1))
  assert estimate.gradients == pytest.approx(
      2 * psi / (n if stage in (2, 3) else 1))
  assert estimate.optimizer == pytest.approx(12 * psi / (n if stage else 1))
  assert estimate.activations == 0


def test_plan_prints_the_table_1_row():
  result = planner.plan(7.5e9, 64, "32GB", precision="mixed")
  table = result.table()
  rows = {line.lstrip("* ").split("  ")[0]: line
          for line in table.splitlines()[2:]}
  for stage, total in PAPER_TABLE_1.items():
    name = "DP64" + (f" + ZeRO-{stage}" if stage else "")
    assert f"{total} GB" in rows[name]
  print("\n" + str(result))


def _fit_one_step(model, x, y, batch, callbacks=()):
  model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0,
            shuffle=False, callbacks=list(callbacks))


def _data_parallel(stage):
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  with strategy.scope():
    model = dp_common.build_model()
  x, y = dp_common.make_data()
  _fit_one_step(model, x, y, 32,
                [tfpar.ZeRO(stage=stage)] if stage else [])
  return strategy, model, dp_common.build_model(), Layout(data=4, zero=stage)


def _tensor_parallel():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = tp_common.compile_model(tp_common.mlp())
  x, y = tp_common.data("mlp", count=8)
  _fit_one_step(model, x, y, 8)
  return (strategy, model, tp_common.compile_model(tp_common.mlp()),
          Layout(data=2, tensor=2))


def _pipeline():
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2)
  with strategy.scope():
    model = pp_common.residual_chain()
    pp_common.compile_model(model)
  x, y, _ = pp_common.data(16)
  _fit_one_step(model, x, y, 16)
  reference = pp_common.residual_chain()
  pp_common.compile_model(reference)
  return (strategy, model, reference,
          Layout(data=2, pipeline=2, num_microbatches=2))


LAYOUTS = {
    "data parallel": lambda: _data_parallel(None),
    "ZeRO-1": lambda: _data_parallel(1),
    "ZeRO-3": lambda: _data_parallel(3),
    "tensor parallel": _tensor_parallel,
    "pipeline": _pipeline,
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_estimates_agree_with_memory_report(name):
  strategy, model, reference, layout = LAYOUTS[name]()
  report = tfpar.memory_report(model)
  # The estimate is for a plain model of the same architecture.
  estimate = planner.estimate_layout(reference, layout)
  # The fullest device of the layout: stage `estimate.stage` of replica 0.
  device = strategy.mesh.replica_devices(0)[estimate.stage * layout.tensor]
  measured_parameters = report.parameters[device]
  measured_optimizer = report.optimizer[device]
  print(f"\n| {name} | {layout.name} | {estimate.parameters:,} | "
        f"{measured_parameters:,} | {estimate.optimizer:,} | "
        f"{measured_optimizer:,} |")
  assert estimate.parameters == pytest.approx(measured_parameters, rel=0.03)
  assert estimate.optimizer == pytest.approx(measured_optimizer, rel=0.03)
  # No device holds more than the fullest one the planner names.
  assert max(report.parameters.values()) == measured_parameters


def _accumulating_data_parallel(stage):
  strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": 4}))
  with strategy.scope():
    model = dp_common.build_model(gradient_accumulation_steps=2)
  x, y = dp_common.make_data()
  _fit_one_step(model, x, y, 32, [tfpar.ZeRO(stage=stage)] if stage else [])
  return strategy, model, dp_common.build_model(), Layout(data=4, zero=stage)


def _accumulating_tensor_parallel():
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "tensor": 2}))
  with strategy.scope():
    model = tp_common.compile_model(tp_common.mlp(),
                                    gradient_accumulation_steps=2)
  x, y = tp_common.data("mlp", count=8)
  _fit_one_step(model, x, y, 8)
  return (strategy, model, tp_common.compile_model(tp_common.mlp()),
          Layout(data=2, tensor=2))


ACCUMULATING = {
    "data parallel": lambda: _accumulating_data_parallel(None),
    "ZeRO-1": lambda: _accumulating_data_parallel(1),
    "ZeRO-2": lambda: _accumulating_data_parallel(2),
    "tensor parallel": _accumulating_tensor_parallel,
}


def _accumulator_bytes(optimizer):
  """{device: bytes} of the optimizer's gradient accumulators, counted from
  each per-device tf.Variable."""
  found = {}
  for variable in optimizer.variables:
    if not variable.name.endswith("gradient_accumulator"):
      continue
    value = getattr(variable, "_value", variable)
    for component in getattr(value, "values", (value,)):
      found[component.device] = found.get(component.device, 0) + (
          component.shape.num_elements() * component.dtype.size)
  return found


@pytest.mark.parametrize("name", list(ACCUMULATING))
def test_gradient_accumulators_are_counted_as_keras_keeps_them(name):
  strategy, model, reference, layout = ACCUMULATING[name]()
  measured = _accumulator_bytes(model.optimizer)
  # Keras keeps one accumulator per trainable weight, as large as it.
  weight_bytes = sum(4 * int(np.prod(v.shape))
                     for v in reference.trainable_weights)
  assert sum(measured.values()) >= weight_bytes
  estimate = planner.estimate_layout(reference, layout,
                                     gradient_accumulation_steps=2)
  without = planner.estimate_layout(reference, layout)
  device = strategy.mesh.replica_devices(0)[estimate.stage * layout.tensor]
  print(f"\n| {name} | {layout.name} | {estimate.accumulators:,} | "
        f"{measured[device]:,} |")
  assert without.accumulators == 0
  assert estimate.total == without.total + estimate.accumulators
  assert estimate.accumulators == pytest.approx(measured[device], rel=0.03)
  assert max(measured.values()) == measured[device]
  # The optimizer's other state is what the estimate says it is.
  report = tfpar.memory_report(model).optimizer[device]
  assert estimate.optimizer == pytest.approx(report - measured[device],
                                             rel=0.03)


def test_plan_takes_accumulation_from_the_optimizer_and_the_flag(tmp_path):
  from tfpar import recipes  # pylint: disable=g-import-not-at-top
  accumulating = dp_common.build_model(gradient_accumulation_steps=4)
  result = planner.plan(accumulating, 4, "1GB", batch_size=32)
  assert result.gradient_accumulation_steps == 4
  assert "gradient accumulation over 4 steps" in result.title()
  assert "accumulators" in result.table().splitlines()[1]
  path = result.write_recipe(str(tmp_path / "planned.toml"))
  assert recipes.load(path).training == {"gradient_accumulation_steps": 4}
  plain = planner.plan(dp_common.build_model(), 4, "1GB", batch_size=32)
  assert plain.gradient_accumulation_steps is None
  assert "accumulators" not in plain.table()
  flagged = planner.plan(dp_common.build_model(), 4, "1GB", batch_size=32,
                         gradient_accumulation_steps=4)
  assert _totals(flagged) == _totals(result)
  # On the device, or with ZeRO-2/3 offload on the host.
  assert all(c.memory.accumulators or (c.layout.offload and c.layout.zero > 1)
             for c in flagged.candidates)


def test_activations_follow_layer_output_shapes():
  model = dp_common.build_model()
  # One saved tensor per layer output, plus the input, per sample.
  per_sample = model.inputs[0].shape[1] + sum(
      int(np.prod(layer.output.shape[1:])) for layer in model.layers)
  estimate = planner.estimate_layout(model, Layout(data=4), batch_size=32)
  assert estimate.activations == per_sample * (32 // 4) * 4
  mixed = planner.estimate_layout(model, Layout(data=4), "mixed",
                                  batch_size=32)
  assert mixed.activations == estimate.activations // 2


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_policies_keep_float32_states_and_halve_activations(policy):
  import keras  # pylint: disable=g-import-not-at-top
  keras.mixed_precision.set_global_policy(policy)
  try:
    model = dp_common.build_model()
    outputs = [layer.output.dtype for layer in model.layers]
  finally:
    keras.mixed_precision.set_global_policy("float32")
  # Measured: Keras keeps float32 variables under its mixed policies, and
  # every layer output (what backward keeps) is in the 2-byte compute dtype.
  assert {v.dtype for v in model.weights} == {"float32"}
  assert set(outputs) == {policy.split("_")[1]}
  weight_bytes = sum(4 * int(np.prod(v.shape)) for v in model.weights)
  for layout in (Layout(data=4), Layout(data=4, zero=3)):
    fp32 = planner.estimate_layout(model, layout, batch_size=32)
    mixed = planner.estimate_layout(model, layout, policy, batch_size=32)
    assert (mixed.parameters, mixed.gradients, mixed.optimizer) == (
        fp32.parameters, fp32.gradients, fp32.optimizer)
    assert mixed.activations == fp32.activations // 2
  assert planner.estimate_layout(model, Layout(data=4),
                                 policy).parameters == weight_bytes


def test_a_plan_in_a_keras_policy_writes_it_into_the_recipe(tmp_path):
  from tfpar import recipes  # pylint: disable=g-import-not-at-top
  result = planner.plan(7.5e9, 64, "32GB", precision="mixed_bfloat16")
  path = result.write_recipe(str(tmp_path / "planned.toml"))
  assert recipes.load(path).training == {"precision": "mixed_bfloat16"}
  fp32 = planner.plan(7.5e9, 64, "32GB")
  path = fp32.write_recipe(str(tmp_path / "fp32.toml"))
  assert recipes.load(path).training is None


def test_pipeline_activations_by_schedule_and_recompute():
  model = pp_common.residual_chain()
  pp_common.compile_model(model)
  estimate = lambda **kw: planner.estimate_layout(
      model, Layout(pipeline=2, num_microbatches=8, **kw), batch_size=64)
  one_f_one_b, gpipe = estimate(), estimate(schedule="gpipe")
  recompute = estimate(recompute=True)
  # 1F1B keeps at most p = 2 micro-batches in flight, GPipe all m = 8.
  assert gpipe.activations == pytest.approx(4 * one_f_one_b.activations,
                                            rel=0.01)
  assert recompute.activations < one_f_one_b.activations
  assert gpipe.parameters == one_f_one_b.parameters


def test_small_model_gets_data_parallelism():
  result = planner.plan(dp_common.build_model(), 4, "1GB", batch_size=32)
  layout = result.recommended.layout
  assert (layout.data, layout.zero, layout.tensor, layout.pipeline) == (
      4, None, 1, 1)
  assert "Does your model fit on a single GPU" in result.reason


def _totals(result):
  return {c.name: c.memory.total for c in result.candidates}


def test_model_that_does_not_fit_data_parallelism_gets_zero():
  model = pp_common.residual_chain()
  pp_common.compile_model(model)
  totals = _totals(planner.plan(model, 4, "1GB", batch_size=16))
  between = (totals["DP4"] + totals["DP4 + ZeRO-1"]) // 2
  result = planner.plan(model, 4, between, batch_size=16)
  assert result.recommended.name == "DP4 + ZeRO-1"
  assert "DP4 needs" in result.reason
  assert "Memory limited -> ZeRO" in result.reason
  between = (totals["DP4 + ZeRO-2"] + totals["DP4 + ZeRO-3"]) // 2
  result = planner.plan(model, 4, between, batch_size=16)
  assert result.recommended.name == "DP4 + ZeRO-3"
  assert "50% communication" in result.reason


def test_recommendation_is_the_fastest_runnable_fit_at_every_limit():
  model = tp_common.compile_model(tp_common.gpt())
  everything = planner.plan(model, 4, "1GB", batch_size=8).candidates
  ranks = [c.rank for c in everything]
  assert ranks == sorted(ranks)
  for limit in sorted({c.memory.total for c in everything}):
    result = planner.plan(model, 4, limit, batch_size=8)
    fitting = [c for c in result.candidates if c.memory.total <= limit]
    runnable = [c for c in fitting if c.supported]
    expected = runnable[0] if runnable else fitting[0]
    assert result.recommended is expected


def test_model_parallel_recommendation_quotes_the_interconnect_rule():
  model = tp_common.compile_model(tp_common.gpt())
  candidates = planner.plan(model, 4, "1GB", batch_size=8).candidates
  # The first runnable model-parallel layout that needs less memory than
  # every faster runnable one.
  faster, chosen = [], None
  for candidate in candidates:
    if not candidate.supported:
      continue
    layout = candidate.layout
    if layout.tensor * layout.pipeline > 1 and all(
        c.memory.total > candidate.memory.total for c in faster):
      chosen = candidate
      break
    faster.append(candidate)
  assert chosen is not None
  result = planner.plan(model, 4, chosen.memory.total, batch_size=8)
  assert result.recommended.name == chosen.name
  assert "Use TP within nodes (NVLink), PP across nodes" in result.reason
  assert "Faster layouts do not fit" in result.reason


def test_nothing_fits_says_so():
  result = planner.plan(tp_common.gpt(), 4, "1KB", batch_size=8)
  assert result.recommended is None
  smallest = min(result.candidates, key=lambda c: c.memory.total)
  assert result.reason.startswith("Nothing fits in 1 KB per device on 4 "
                                  "devices")
  assert smallest.name in result.reason
  assert "Try about" in result.reason


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(devices=0), r"devices must be a positive integer\. Received: "
     r"devices=0"),
    (dict(memory_per_device="16XB"), r"memory_per_device must be a positive "
     r"size such as '16GB'.*Received: memory_per_device='16XB'"),
    (dict(precision="fp8"), r"precision must be one of 'fp32', 'mixed', "
     r"'mixed_float16', 'mixed_bfloat16'\. Received: precision='fp8'"),
    (dict(batch_size=0), r"batch_size must be a positive integer\. Received: "
     r"batch_size=0"),
    (dict(model="big"), r"model must be a built Keras model or a parameter "
     r"count.*Received: model='big'"),
    (dict(gradient_accumulation_steps=0), r"gradient_accumulation_steps "
     r"must be a positive integer \(1 for no accumulation\)\. Received: "
     r"gradient_accumulation_steps=0"),
])
def test_bad_input_names_the_setting(kwargs, pattern):
  settings = dict(model=1e6, devices=4, memory_per_device="16GB")
  settings.update(kwargs)
  with pytest.raises(ValueError, match=pattern):
    planner.plan(**settings)


def test_bad_layouts_name_the_setting():
  with pytest.raises(ValueError, match=r"offload needs a ZeRO stage"):
    Layout(data=2, offload="cpu")
  with pytest.raises(ValueError, match=r"tensor must be a positive integer"):
    Layout(tensor=0)
  with pytest.raises(ValueError, match=r"recompute .* needs pipeline >= 2"):
    Layout(recompute=True)


def _bars(image, color):
  """[(left, right)] column runs of `color` in the lowest row where the
  most runs appear."""
  match = np.all(image == np.array(color, np.uint8), axis=-1)
  best = []
  for row in range(image.shape[0] - 1, -1, -1):
    columns = np.flatnonzero(match[row])
    if not len(columns):
      continue
    splits = np.flatnonzero(np.diff(columns) > 1)
    runs = list(zip(np.r_[columns[0], columns[splits + 1]],
                    np.r_[columns[splits], columns[-1]]))
    if len(runs) > len(best):
      best = runs
  return best


def test_plot_draws_one_bar_per_candidate(tmp_path):
  model = pp_common.residual_chain()
  pp_common.compile_model(model)
  result = planner.plan(model, 4, "12KB", batch_size=16)
  path = result.plot(str(tmp_path / "plan.png"))
  image = tf.io.decode_png(tf.io.read_file(path)).numpy()
  shown = result.shown()
  assert image.ndim == 3 and image.shape[2] == 3
  parameters_color = dict(chart.PARTS)["parameters"]
  bars = _bars(image, parameters_color)
  assert len(bars) == len(shown)
  # Bar heights (all four colours) are proportional to the totals.
  colors = np.array([c for _, c in chart.PARTS], np.uint8)
  heights = []
  for left, right in bars:
    column = image[:, (left + right) // 2]
    heights.append(int(np.any(np.all(column[:, None] == colors[None],
                                      -1), -1).sum()))
  totals = [c.memory.total for c in shown]
  scale = max(heights) / max(totals)
  for height, total in zip(heights, totals):
    assert abs(height - total * scale) <= 4  # Rounding of each segment.
  # The memory limit is a red line across the plot.
  red = np.all(image == np.array(chart.LIMIT, np.uint8), -1).sum(1)
  assert red.max() > len(shown) * 10


def _cli(argv):
  parser = argparse.ArgumentParser(prog="tfpar")
  planner_cli.add_parser(parser.add_subparsers(dest="command"))
  return planner_cli.run(parser.parse_args(argv))


def test_cli_counts_accumulators_and_writes_them_to_the_recipe(
    capsys, tmp_path):
  from tfpar import recipes  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "planned.toml")
  code = _cli(["plan", "--parameters", "7.5e9", "--devices", "64",
               "--memory-per-device", "40GB", "--precision", "mixed_bfloat16",
               "--gradient-accumulation-steps", "8", "--write-recipe", path])
  out = capsys.readouterr().out
  assert code == 0
  # 4 bytes per parameter, whole under plain data parallelism and ZeRO-1,
  # 1/64 under ZeRO-2/3.
  lines = out.splitlines()
  header = re.split(r"\s{2,}", lines[1])
  column = header.index("accumulators")
  rows = {cells[0].lstrip("* "): cells for cells in (
      re.split(r"\s{2,}", line) for line in lines[2:]) if len(cells) > 4}
  assert rows["DP64"][column] == "30 GB"
  assert rows["DP64 + ZeRO-1"][column] == "30 GB"
  assert rows["DP64 + ZeRO-2"][column] == "469 MB"
  assert rows["DP64 + ZeRO-3"][column] == "469 MB"
  assert recipes.load(path).training == {"precision": "mixed_bfloat16",
                                         "gradient_accumulation_steps": 8}
  assert _cli(["plan", "--parameters", "1e6", "--devices", "4",
               "--memory-per-device", "16GB", "--gradient-accumulation-steps",
               "-1"]) == 2
  assert "gradient_accumulation_steps=-1" in capsys.readouterr().err


def test_cli_model_free(capsys):
  code = _cli(["plan", "--parameters", "7.5e9", "--devices", "64",
               "--memory-per-device", "32GB", "--precision", "mixed"])
  out = capsys.readouterr().out
  assert code == 0
  assert "Recommended: DP64 + ZeRO-1." in out
  for total in PAPER_TABLE_1.values():
    assert f"{total} GB" in out
  print(out)


def test_cli_with_a_model_function_and_plot(capsys, tmp_path):
  png = tmp_path / "plan.png"
  code = _cli(["plan", "--model", "tp_common:mlp", "--devices", "4",
               "--memory-per-device", "64KB", "--batch-size", "8",
               "--plot", str(png)])
  out = capsys.readouterr().out
  assert code == 0
  assert "'mlp' on 4 devices" in out and "Recommended: " in out
  assert tf.io.decode_png(tf.io.read_file(str(png))).shape[2] == 3
  print(out)


def test_cli_with_a_keras_file_and_errors(capsys, tmp_path):
  path = str(tmp_path / "chain.keras")
  pp_common.residual_chain().save(path)
  assert _cli(["plan", "--model", path, "--devices", "4",
               "--memory-per-device", "10B"]) == 1
  assert "Nothing fits in 10 B per device" in capsys.readouterr().out
  assert _cli(["plan", "--parameters", "1e6", "--devices", "4",
               "--memory-per-device", "16XB"]) == 2
  assert "memory_per_device='16XB'" in capsys.readouterr().err
  assert _cli(["plan", "--model", "no_such_module:f", "--devices", "4",
               "--memory-per-device", "16GB"]) == 2
  assert "cannot import 'no_such_module'" in capsys.readouterr().err
