"""3D parallelism: a pipeline whose stages are tensor-parallel, replicated
over `data`, with and without tfpar.ZeRO, equal to one device (under
Keras's mixed policies: within the spread of stock MirroredStrategy).

The 8-device runs need their own virtual CPUs, so they run
tests/workers/td_worker.py in a subprocess (this process has 4), and
across 2 TF_CONFIG workers with `tfpar launch`.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import precision_common
import suite_scope
import tfpar
import tp_common

WORKER = os.path.join(os.path.dirname(__file__), "workers", "td_worker.py")
PRECISION_WORKER = os.path.join(os.path.dirname(__file__), "workers",
                                "td_precision_worker.py")
TIMEOUT = 400


@pytest.fixture(scope="module")
def reference():
  one_device = tp_common.trained_gpt()  # Shared with the other GPT tests.
  model, losses = one_device.model, one_device.losses
  px, py = tp_common.data("gpt", count=16, seed=7)
  return {"losses": losses,
          "evaluate": model.evaluate(px, py, batch_size=8, verbose=0),
          "predict": model.predict(px, batch_size=8, verbose=0),
          "weights": tfpar.logical_weights(model)}


def _run(command, out_dir, name, workers=1):
  run = subprocess.run(command, capture_output=True, text=True,
                       timeout=TIMEOUT + 60)
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  return [json.load(open(os.path.join(out_dir, f"{name}_worker{i}.json")))
          for i in range(workers)]


def _assert_same_as(reference, result):
  np.testing.assert_allclose(result["losses"], reference["losses"],
                             atol=1e-5, rtol=0)
  np.testing.assert_allclose(result["evaluate"], reference["evaluate"],
                             atol=1e-5)
  np.testing.assert_allclose(result["predict"], reference["predict"],
                             atol=1e-5)
  assert sorted(result["weights"]) == sorted(reference["weights"])
  print("losses", np.abs(np.subtract(result["losses"],
                                     reference["losses"])).max(),
        "weights", max(np.abs(np.subtract(result["weights"][path],
                                          value)).max()
                       for path, value in reference["weights"].items()))
  for path, value in reference["weights"].items():
    np.testing.assert_allclose(result["weights"][path], value, atol=1e-5,
                               err_msg=path)


def _assert_stage_shards_on_stage_devices(result, tensor):
  """One variable per weight of a stage-s layer on every device of the
  stage's tensor groups (devices s x tensor .. s x tensor + tensor - 1 of
  each replica), its k-th component there shard k; unsplit ones on all of
  them too."""
  groups = result["groups"]
  devices = result["devices"]
  for block, stage in (("block0", 0), ("block1", 1)):
    stage_devices = [g[stage * tensor + k] for g in groups
                     for k in range(tensor)]
    assert devices[f"{block}_mlp_in/kernel"] == stage_devices
    assert devices[f"{block}_ln1/gamma"] == stage_devices


# (data, schedule, ZeRO stage) on pipeline 2 x tensor 2: two
# replicas, 1F1B, ZeRO-3 (ZeRO-2 runs across workers and under mixed
# policies below); TFPAR_TEST_FULL=1 adds one replica under each schedule
# (test_whole_weights and test_precision_matrix's pipeline 2 x tensor 2 run
# one replica, and test_pipeline every schedule without a tensor axis) and
# GPipe with ZeRO-1.
CASES = suite_scope.cases(
    [(2, "1f1b", 3)],
    [(1, "gpipe", 0), (1, "1f1b", 0), (2, "gpipe", 1)])


@pytest.fixture(scope="module")
def one_host_runs(tmp_path_factory):
  """Every CASES entry, run by one td_worker process (TensorFlow and its 8
  virtual CPUs start once): case -> the worker's result."""
  out_dir = tmp_path_factory.mktemp("three_d")
  names = [f"d{data}_{schedule}_zero{stage}"
           for data, schedule, stage in CASES]
  _run([sys.executable, WORKER, str(out_dir)] +
       [f"{name},{data},2,2,{schedule},{stage}"
        for name, (data, schedule, stage) in zip(names, CASES)],
       out_dir, names[0])
  return {case: json.load(open(out_dir / f"{name}_worker0.json"))
          for name, case in zip(names, CASES)}


@pytest.mark.parametrize("data,schedule,zero_stage", CASES)
def test_pipeline_of_tensor_parallel_stages_matches_one_device(
    reference, one_host_runs, data, schedule, zero_stage):
  result = one_host_runs[(data, schedule, zero_stage)]
  assert result["num_replicas"] == data
  _assert_same_as(reference, result)
  _assert_stage_shards_on_stage_devices(result, tensor=2)
  if zero_stage:
    _assert_zero_slices_over_data(reference, result, zero_stage, tensor=2)


def _assert_zero_slices_over_data(reference, result, zero_stage, tensor=1):
  """Optimizer state, and under ZeRO-3 the weights, held once in all the
  replicas together instead of once per replica (under SPMD a replicated
  weight once per device of its tensor group: `tensor` copies)."""
  assert result["split"]
  weights = sum(np.asarray(v, np.float32).nbytes *
                (1 if path in result["split"] else tensor)
                for path, v in reference["weights"].items())
  # Adam's 2 moments, plus under stages 1-2 the weight slice each replica
  # updates (under stage 3 that slice is the weight itself).
  state = sum(result["optimizer_bytes"].values())
  expected_state = (2 if zero_stage == 3 else 3) * weights
  assert abs(state - expected_state) < 0.02 * expected_state, (state, weights)
  held = sum(result["parameter_bytes"].values())
  copies = 1 if zero_stage == 3 else result["num_replicas"]
  assert abs(held - copies * weights) < 0.02 * copies * weights, (held,
                                                                  weights)


def test_3d_under_mixed_policies_and_accumulation_matches_one_device(
    tmp_path):
  """data 2 x pipeline 2 x tensor 2 with ZeRO-2 under mixed_bfloat16 (and,
  with TFPAR_TEST_FULL=1, without ZeRO under mixed_float16): within the
  spread of
  stock MirroredStrategy (2 CPUs) vs one device under the same policy,
  measured in the same process. With ZeRO-2 and
  Adam(gradient_accumulation_steps=2) (float32): equal to one device with
  the same k."""
  out = str(tmp_path / "precision.json")
  # 6 trainings, 2 of them 3D (9 and 3 with TFPAR_TEST_FULL=1).
  run = subprocess.run([sys.executable, PRECISION_WORKER, out],
                       capture_output=True, text=True, timeout=1800)
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  results = json.load(open(out))
  policies = [policy for policy in ("mixed_float16", "mixed_bfloat16")
              if policy in results]
  assert policies == suite_scope.cases([], ["mixed_float16"]) + [
      "mixed_bfloat16"], policies
  for policy in policies:
    spread = results[policy]["mirrored"]
    layout = {"mixed_float16": "3d", "mixed_bfloat16": "3d ZeRO-2"}[policy]
    measured = results[policy][layout]
    print(f"{policy} {layout}: losses {measured[0]:.1e} weights "
          f"{measured[1]:.1e} first loss {measured[2]:.1e}; mirrored "
          f"{spread[0]:.1e} / {spread[1]:.1e}")
    precision_common.assert_within_spread(
        policy, True, measured, spread,
        first_loss=results[policy]["first loss"])
  accumulation = results["float32, accumulation 2"]
  print(f"float32, accumulation 2: {accumulation}")
  assert max(accumulation["3d ZeRO-2"]) < 1e-5, accumulation
  # Losses and weights (the first forward is the same without it).
  assert min(accumulation["one device without accumulation"][:2]) > 1e-3


def test_3d_across_two_workers_with_zero2_matches_one_device(reference,
                                                             tmp_path):
  """Each worker holds one replica's pipeline (data across the workers);
  its batches' size is unknown when traced, so the step keeps the loss's
  shape `Assert`s (which once deadlocked SPMD stages across workers)."""
  results = _run(
      [sys.executable, "-m", "tfpar", "launch", "--workers", "2",
       "--devices-per-worker", "4", "--timeout", str(TIMEOUT), WORKER,
       str(tmp_path), "mw,2,2,2,1f1b,2"], tmp_path, "mw",
      workers=2)
  for worker, result in enumerate(results):
    assert result["num_replicas"] == 2
    assert [len(g) for g in result["groups"]] == [4]
    assert all(f"task:{worker}" in d for d in result["groups"][0])
    assert result["extended"] == "TensorStagesExtended"
    _assert_stage_shards_on_stage_devices(result, tensor=2)
    _assert_same_as(reference, result)
  assert results[0]["weights"] == results[1]["weights"]


def test_describe_stages_lists_each_stage_tensor_group():
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2)
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt())
  lines = strategy.describe_stages(model, print_fn=None).splitlines()
  devices = strategy.mesh.replica_devices(0)
  assert lines[2].endswith(f"{devices[0]} {devices[1]}")
  assert lines[3].endswith(f"{devices[2]} {devices[3]}")


def test_hidden_size_not_divisible_by_tensor_is_an_error():
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"pipeline": 2, "tensor": 2}), num_microbatches=2)
  with pytest.raises(ValueError, match="= 5 is not divisible by the mesh's "
                     "tensor size 2"):
    with strategy.scope():
      keras.Sequential([keras.Input((4,)),
                        keras.layers.Dense(5, activation="relu"),
                        keras.layers.Dense(4), keras.layers.Dense(3),
                        keras.layers.Dense(2)])


def test_plan_without_tensor_axis_is_an_error():
  with pytest.raises(ValueError, match="plan splits layers over the mesh's "
                     "tensor axis, but this mesh has tensor=1"):
    tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"pipeline": 2}), num_microbatches=2,
        plan=[("dense", tfpar.ColumnParallel())])


def test_tensor_stages_whose_pipeline_crosses_workers_are_refused():
  """A pipeline across workers is driven by the chief
  (tfpar.pipeline.cross_worker), which has no tensor-parallel stages: a
  ValueError before any worker connects, instead of a hang."""
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["127.0.0.1:2000", "127.0.0.1:2001"]}),
      task_type="worker", task_id=1)
  mesh = tfpar.Mesh.from_cluster_resolver(resolver, data=1, pipeline=4,
                                          tensor=2)
  assert len({mesh.worker_of(d) for d in mesh.replica_devices(0)}) == 2
  with pytest.raises(ValueError, match=r"Tensor-parallel stages \(tensor=2\) "
                     r"need each pipeline inside one worker: put the workers "
                     r"on the 'data' axis"):
    tfpar.PipelineParallelStrategy(mesh, num_microbatches=4)


def test_spmd_must_be_none_or_true():
  with pytest.raises(ValueError, match=r"spmd must be one of None, True"):
    tfpar.PipelineParallelStrategy(tfpar.Mesh({"pipeline": 2, "tensor": 2}),
                                   num_microbatches=2, spmd="yes")
