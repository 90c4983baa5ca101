"""tfpar's public names: what users call, nothing internal."""

import importlib

import pytest

import tfpar

_PUBLIC = {
    "BackupAndRestore", "ClusterLayout", "ColumnParallel",
    "CommunicationLog", "DataParallelStrategy", "ExpertParallelStrategy",
    "Mesh", "MeshAxis", "MoE", "ModelCheckpoint", "PipelineParallelStrategy",
    "PipelineTrace",
    "Replicate", "RowParallel", "ShardedWeight", "ShardingPlan",
    "TensorParallelStrategy", "TrainingMonitor", "VocabParallel", "ZeRO",
    "configure_virtual_cpus", "from_keras_distribution", "from_recipe",
    "keep_global_batch",
    "logical_weights", "memory_report", "plan_layout", "save_weights",
    "expert_parallel", "pipeline", "planner", "recipes", "tensor_parallel",
    "tpu", "zero",
}


def test_all_lists_exactly_the_public_names():
  assert set(tfpar.__all__) == _PUBLIC
  assert sorted(dir(tfpar)) == sorted(_PUBLIC)


@pytest.mark.parametrize("name", sorted(_PUBLIC))
def test_every_public_name_resolves(name):
  assert getattr(tfpar, name) is not None


@pytest.mark.parametrize(
    "name", ["cluster", "engine", "launch", "local_devices", "mesh",
             "preemption"])
def test_implementation_modules_stay_importable_but_are_not_api(name):
  assert name not in tfpar.__all__
  assert getattr(tfpar, name) is importlib.import_module(f"tfpar.{name}")


def test_the_planner_no_longer_shares_its_name_with_the_plan_argument():
  assert tfpar.plan_layout is importlib.import_module("tfpar.planner").plan
  with pytest.warns(DeprecationWarning, match="renamed tfpar.plan_layout"):
    old = tfpar.plan
  assert old is tfpar.plan_layout


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
    tfpar.no_such_thing  # pylint: disable=pointless-statement
