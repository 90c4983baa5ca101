"""`tfpar plan` knows the build: a layout whose model cannot be built in
the memory given is not recommended (tfpar/planner/build_peak.py)."""

from tfpar import planner


def _candidate(result, name):
  return next(c for c in result.candidates if c.name == name)


def test_zero3_across_nodes_builds_the_whole_model():
  # 7.5B parameters, fp16 weights: 15 GB. ZeRO-3 over 64 devices needs
  # 1.88 GB per step, but as a fit callback across nodes each replica holds
  # the whole model until fit slices it.
  result = planner.plan(7.5e9, 64, "10GB", precision="mixed")
  zero3 = _candidate(result, "DP64 + ZeRO-3")
  assert zero3.memory.total < 2e9
  assert zero3.build_peak == 15e9
  assert not zero3.fits
  assert result.recommended.build_peak <= 10e9
  assert result.recommended.name != "DP64 + ZeRO-3"
  assert "build" in result.table().splitlines()[1]


def test_zero3_inside_a_node_builds_sliced():
  result = planner.plan(7.5e9, 8, "16GB", precision="mixed")
  zero3 = _candidate(result, "DP8 + ZeRO-3")
  assert zero3.build_peak == 15e9 / 8
  assert zero3.fits


def test_tensor_and_pipeline_build_their_share():
  result = planner.plan(8e9, 8, "80GB", precision="fp32", node_size=8)
  assert _candidate(result, "DP1 x TP8").build_peak == 4e9
  assert _candidate(result, "DP1 x PP8").build_peak == 4e9
  # ZeRO-1 over data 2 does not slice the weights: each replica builds its
  # tensor-4 share, 8 GB.
  assert _candidate(result, "DP2 x TP4 + ZeRO-1").build_peak == 8e9
