"""The interleaved 1F1B schedule (Megatron-LM's): the model is cut into
v x p stages and device d runs stages d, d + p, ... Equality with one
device, the schedule's bubble against (p - 1) / (v m + p - 1) in an
event simulation written here, placement, the trace, bad input."""

import types

import pytest
import tensorflow as tf

import pp_common
import tfpar
from tfpar.pipeline import schedules
from tfpar.recipes import schema


def _strategy(pipeline=2, data=2, m=4, v=2, **kwargs):
  return tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": data, "pipeline": pipeline}), num_microbatches=m,
      schedule="interleaved", virtual_stages=v, **kwargs)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """data 2 x pipeline 2, v = 2 (4 stages), m = 4, traced at batch 2."""
  log_dir = tmp_path_factory.mktemp("interleaved")
  strategy = _strategy()
  callback = tfpar.PipelineTrace(str(log_dir), step=2, verbose=False)
  result = pp_common.train(strategy, callbacks=[callback])
  return types.SimpleNamespace(strategy=strategy, result=result,
                               trace=callback.trace, log_dir=log_dir)


def _simulated_makespan(orders, forward, backward):
  """Each device runs its order one item at a time; an item starts when
  its device is free and its inputs are done (transfers take no time)."""
  last = 1 + max(w.stage for order in orders for w in order)
  end, free, position = {}, [0.0] * len(orders), [0] * len(orders)
  while any(p < len(o) for p, o in zip(position, orders)):
    for d, order in enumerate(orders):
      if position[d] == len(order):
        continue
      work = order[position[d]]
      s, k = work.stage, work.microbatch
      if work.phase == schedules.FORWARD:
        inputs = [(s - 1, k, schedules.FORWARD)] if s else []
      else:
        inputs = [(s, k, schedules.FORWARD)] + (
            [(s + 1, k, schedules.BACKWARD)] if s < last - 1 else [])
      inputs = [schedules.Work(*i) for i in inputs]
      if all(i in end for i in inputs):
        start = max([free[d]] + [end[i] for i in inputs])
        end[work] = free[d] = start + (
            forward if work.phase == schedules.FORWARD else backward)
        position[d] += 1
  return max(end.values())


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4),
                                   (2, 8, 3), (3, 6, 2), (4, 4, 2)])
def test_orders_are_complete_and_reach_the_bubble_formula(p, m, v):
  orders = schedules.device_orders("interleaved", p, m, v)
  for d, order in enumerate(orders):
    assert sorted(order) == sorted(
        schedules.Work(s, k, phase) for s in range(d, v * p, p)
        for k in range(m) for phase in (schedules.FORWARD, schedules.BACKWARD))
  schedules.build_order(orders)  # No deadlock.
  # Equal stages: a device's v stages take 1 forward and 2 backward units.
  makespan = _simulated_makespan(orders, 1 / v, 2 / v)
  measured = 1 - 3 * m / makespan
  assert measured == pytest.approx(schedules.bubble_fraction(p, m, v))
  one_f_one_b = 1 - 3 * m / _simulated_makespan(
      schedules.device_orders("1f1b", p, m), 1, 2)
  assert one_f_one_b == pytest.approx(schedules.bubble_fraction(p, m))
  assert measured < one_f_one_b


def test_trains_like_one_device(run):
  pp_common.assert_same_training(pp_common.one_device(), run.result)


def test_with_recomputation_and_tensor_stages_trains_like_one_device():
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2,
      schedule="interleaved", virtual_stages=2, recompute=True)
  pp_common.assert_same_training(pp_common.one_device(),
                                 pp_common.train(strategy))


def test_stage_s_lives_on_device_s_mod_p(run):
  model = run.result[4]
  for stage in model._tfpar_stage_plan.stages:  # pylint: disable=protected-access
    for variable in stage.variables:
      devices = {tf.DeviceSpec.from_string(c.device).device_index
                 for c in variable.value.values}
      # Replica r's pipeline is devices 2r, 2r + 1 (data 2 x pipeline 2).
      assert devices == {stage.index % 2, 2 + stage.index % 2}, (
          stage.index, variable.path, devices)
  assert len(model._tfpar_stage_plan.stages) == 4  # pylint: disable=protected-access


def test_trace_shows_each_device_running_the_schedule(run):
  orders = schedules.device_orders("interleaved", 2, 4, 2)
  assert run.trace.pipeline_size == 2 and run.trace.num_stages == 4
  for replica in (0, 1):
    for d in (0, 1):
      ran = [(e.stage, e.microbatch, e.phase) for e in run.trace.events
             if e.replica == replica and run.trace.device_of(e.stage) == d]
      assert ran == [tuple(w) for w in orders[d]]
  assert 0.0 < run.trace.bubble_fraction() < 1.0
  png = tf.io.decode_png(tf.io.read_file(str(run.log_dir / "schedule.png")))
  assert png.shape[0] < 3 * 36  # One lane per device, not per stage.
  assert run.strategy.expected_bubble == pytest.approx(1 / 9)


def test_recipe_takes_the_schedule():
  recipe = schema.validate({
      "summary": "interleaved", "strategy": {
          "kind": "pipeline_parallel", "num_microbatches": 4,
          "schedule": "interleaved", "virtual_stages": 2},
      "mesh": {"pipeline": 2}})
  assert recipe.options["virtual_stages"] == 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule="1f1b", virtual_stages=2), "needs schedule='interleaved'"),
    (dict(schedule="interleaved", virtual_stages=1), "virtual_stages >= 2"),
    (dict(schedule="interleaved", virtual_stages=0), "positive integer"),
    (dict(schedule="interleaved", virtual_stages=True), "positive integer"),
    (dict(schedule="interleaved", virtual_stages=2, num_microbatches=3),
     "multiple of pipeline=2"),
])
def test_bad_settings_are_errors(kwargs, message):
  kwargs.setdefault("num_microbatches", 4)
  with pytest.raises(ValueError, match=message):
    tfpar.PipelineParallelStrategy(tfpar.Mesh({"pipeline": 2}), **kwargs)


def test_too_few_cut_points_for_the_stages_is_an_error():
  strategy = _strategy(m=2, v=4)  # 8 stages.
  with pytest.raises(ValueError, match="stages"):
    with strategy.scope():
      pp_common.residual_chain()  # 6 blocks between cuts.
