"""PipelineParallelStrategy: equality with one device, stages, placement,
schedule order and traces, bad input."""

import functools
import json
import os
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import pp_common
import suite_scope
import tfpar
from tfpar.pipeline import schedules

LAYOUTS = [(2, 2), (4, 1)]  # (pipeline, data) on the 4 test devices.


@pytest.fixture(scope="module")
def reference():
  return pp_common.one_device()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
  """schedule -> the pipeline 2 x data 2, 4 micro-batch run (made once) with
  a PipelineTrace of batch 2: one run for the equality, placement and trace
  tests, which check different things of it."""
  @functools.cache
  def run(schedule):
    log_dir = tmp_path_factory.mktemp(f"trace_{schedule}")
    strategy = _strategy(2, 2, 4, schedule)
    callback = tfpar.PipelineTrace(str(log_dir), step=2, verbose=False)
    result = pp_common.train(strategy, callbacks=[callback])
    return types.SimpleNamespace(strategy=strategy, result=result,
                                 callback=callback, log_dir=log_dir)
  return run


def _strategy(pipeline, data, m, schedule="1f1b", **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # m < p warns; tested below.
    return tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": data, "pipeline": pipeline}),
        num_microbatches=m, schedule=schedule, **kwargs)


# Every (m, layout, schedule) but m = 8 on pipeline 2 x data 2 (m > p
# there is m = 4's case; TFPAR_TEST_FULL=1 adds it).
@pytest.mark.parametrize("m,pipeline,data,schedule", suite_scope.cases(
    [(m, pipeline, data, schedule) for m in (1, 4, 8)
     for pipeline, data in LAYOUTS for schedule in ("gpipe", "1f1b")
     if (m, pipeline) != (8, 2)],
    [(8, 2, 2, schedule) for schedule in ("gpipe", "1f1b")]))
def test_fit_evaluate_predict_match_one_device(reference, traced, schedule,
                                               pipeline, data, m):
  if (pipeline, data, m) == (2, 2, 4):
    result = traced(schedule).result
  else:
    result = pp_common.train(_strategy(pipeline, data, m, schedule))
  pp_common.assert_same_training(reference, result)


def test_activation_recomputation_matches_one_device(reference):
  result = pp_common.train(_strategy(4, 1, 4, recompute=True))
  pp_common.assert_same_training(reference, result)


def test_uneven_final_batch_matches_one_device():
  # 100 rows in batches of 16: the last batch gives each of the 2 replicas
  # 2 rows, in micro-batches of 1, 1, 0 and 0 rows.
  reference = pp_common.train(rows=100, epochs=2)
  result = pp_common.train(_strategy(2, 2, 4), rows=100, epochs=2)
  pp_common.assert_same_training(reference, result)


def test_stage_variables_and_optimizer_state_live_on_stage_devices(traced):
  run = traced("1f1b")
  strategy, model = run.strategy, run.result[-1]
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  by_variable = {}
  for stage in plan.stages:
    expected = {tf.DeviceSpec.from_string(group[stage.index])
                for group in strategy.mesh.replicas}
    for variable in stage.variables:
      by_variable[variable.path] = expected
      devices = {tf.DeviceSpec.from_string(c.device)
                 for c in variable.value.values}
      assert devices == expected, variable.path
  slots = 0
  for variable in model.optimizer.variables:
    owner = next((p for p in by_variable
                  if variable.path.endswith(p.replace("/", "_") + "_momentum")
                  or variable.path.endswith(p.replace("/", "_") +
                                            "_velocity")), None)
    if owner is None:
      continue
    slots += 1
    devices = {tf.DeviceSpec.from_string(c.device)
               for c in variable.value.values}
    assert devices == by_variable[owner], variable.path
  assert slots == 2 * len(model.trainable_weights)


def test_auto_stages_cut_between_blocks_and_describe_them():
  strategy = _strategy(4, 1, 4)
  with strategy.scope():
    model = pp_common.residual_chain()
  text = strategy.describe_stages(model, print_fn=None)
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  starts = [stage.layers[0].name for stage in plan.stages]
  assert starts[0] == "embed"
  assert all(name.endswith("_in") or name == "head" for name in starts[1:])
  assert sum(s.num_params for s in plan.stages) == model.count_params()
  assert plan.imbalance < 1.6
  for stage in plan.stages:
    assert f"{stage.layers[0].name} .. {stage.layers[-1].name}" in text
  assert "CPU:3" in text.splitlines()[-2]  # The last stage; then training.


def test_named_stages_cut_where_the_user_says():
  strategy = _strategy(2, 2, 2, stages=["block3_in"])
  with strategy.scope():
    model = pp_common.residual_chain()
  plan = model._tfpar_stage_plan  # pylint: disable=protected-access
  assert [s.layers[0].name for s in plan.stages] == ["embed", "block3_in"]
  assert [l.name for l in plan.stages[1].layers] == [
      "block3_in", "block3_out", "block3_add", "head"]


def test_sequential_models_are_cut():
  strategy = _strategy(2, 2, 2)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,))] + [
        keras.layers.Dense(4, name=f"d{i}") for i in range(4)])
  assert [s.layers[0].name for s in model._tfpar_stage_plan.stages] == [  # pylint: disable=protected-access
      "d0", "d2"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trace_shows_each_stage_runs_the_schedule_order(traced, schedule):
  run = traced(schedule)
  log_dir, trace = run.log_dir, run.callback.trace
  orders = schedules.stage_orders(schedule, 2, 4)
  for replica in (0, 1):
    for stage in (0, 1):
      assert trace.stage_order(stage, replica) == [
          (w.microbatch, w.phase) for w in orders[stage]]
  assert 0.0 < trace.bubble_fraction() < 1.0
  png = tf.io.decode_png(tf.io.read_file(str(log_dir / "schedule.png")))
  assert png.shape[0] > 2 * 30 and png.shape[2] == 3
  with open(log_dir / "schedule.trace.json") as f:
    events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
  assert len(events) == 2 * 2 * 2 * 4  # replicas x stages x F/B x m.
  assert any(name.endswith(".xplane.pb") for _, _, files in
             os.walk(log_dir / "plugins" / "profile") for name in files)


def test_1f1b_keeps_at_most_p_microbatches_alive_per_stage():
  for p, m in [(2, 8), (4, 8), (4, 16)]:
    gpipe = schedules.stage_orders("gpipe", p, m)
    one_f_one_b = schedules.stage_orders("1f1b", p, m)
    for s in range(p):
      assert schedules.peak_in_flight(gpipe[s]) == m
      assert schedules.peak_in_flight(one_f_one_b[s]) == p - s


def test_bubble_formula():
  assert schedules.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert _strategy(4, 1, 12).expected_bubble == pytest.approx(0.2)


# Bad input.


def test_batch_not_divisible_into_microbatches_is_an_error():
  strategy = _strategy(2, 2, 4)
  with pytest.raises(ValueError, match=r"batch_size=12 .*multiple of data x "
                     r"num_microbatches = 8"):
    pp_common.train(strategy, batch=12, epochs=1)


def test_sum_reduced_loss_is_an_error():
  strategy = _strategy(2, 2, 4)
  with strategy.scope():
    model = pp_common.residual_chain()
    model.compile(optimizer="sgd",
                  loss=keras.losses.MeanSquaredError(reduction="sum"))
  x, y, _ = pp_common.data()
  with pytest.raises(ValueError, match="reduction='sum'; pipeline"):
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_fewer_layers_than_stages_is_an_error():
  strategy = _strategy(4, 1, 4)
  with pytest.raises(ValueError, match="has 2 layers, fewer than the 4"):
    with strategy.scope():
      keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                        keras.layers.Dense(2)])


def test_unknown_cut_name_is_an_error():
  strategy = _strategy(2, 2, 4, stages=["block9_in"])
  with pytest.raises(ValueError, match="'block9_in', which model 'chain'"):
    with strategy.scope():
      pp_common.residual_chain()


def test_cut_inside_a_block_is_an_error():
  strategy = _strategy(2, 2, 4, stages=["block1_out"])
  with pytest.raises(ValueError, match="cannot be cut before layer "
                     "'block1_out'.*block1_in"):
    with strategy.scope():
      pp_common.residual_chain()


def test_model_that_is_not_a_chain_is_an_error():
  strategy = _strategy(4, 1, 4)
  inputs = keras.Input((4,))
  with pytest.raises(ValueError, match="not a chain of 4 blocks"):
    with strategy.scope():
      branches = [keras.layers.Dense(4)(inputs) for _ in range(4)]
      keras.Model(inputs, keras.layers.Concatenate()(branches))


def test_subclassed_model_is_an_error():

  class Custom(keras.Model):

    def __init__(self):
      super().__init__()
      self.dense = keras.layers.Dense(2)

    def call(self, x):
      return self.dense(x)

  strategy = _strategy(2, 2, 4)
  with pytest.raises(ValueError, match="is not a chain of layers"):
    with strategy.scope():
      model = Custom()
      model.build((None, 4))


def test_fewer_microbatches_than_stages_warns_with_the_bubble():
  with pytest.warns(UserWarning, match=r"expected bubble is 60%"):
    tfpar.PipelineParallelStrategy(tfpar.Mesh({"pipeline": 4}),
                                   num_microbatches=2)


@pytest.mark.parametrize("kwargs,message", [
    ({"num_microbatches": 0}, "num_microbatches must be a positive"),
    ({"num_microbatches": 4, "schedule": "zigzag"}, "schedule must be one"),
    ({"num_microbatches": 4, "stages": "embed"}, "stages must be 'auto' or"),
    ({"num_microbatches": 4, "recompute": 1}, "recompute must be True"),
])
def test_bad_arguments_are_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tfpar.PipelineParallelStrategy(tfpar.Mesh({"pipeline": 2}), **kwargs)
