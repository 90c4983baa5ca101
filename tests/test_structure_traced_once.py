"""Preparing a model for tensor parallelism traces it once to find its
attention and MLPs (tfpar/tensor_parallel/structure.py `shared_trace`):
the plan, the MLP pairing and a pipeline's column -> row pairs read the
same throw-away trace instead of tracing the whole model each."""

import numpy as np
import pytest

import tfpar
import tp_common
from tfpar.tensor_parallel import structure


@pytest.fixture
def traces(monkeypatch):
  """A list that grows by one entry per whole-model trace."""
  made = []
  trace = structure._trace_calls  # pylint: disable=protected-access

  def counting(model, layers):
    made.append(model.name)
    return trace(model, layers)

  monkeypatch.setattr(structure, "_trace_calls", counting)
  return made


@pytest.mark.parametrize("mesh,pipeline", [
    ({"data": 2, "tensor": 2}, False),
    # The plan, the pairing and one trace per row layer (2 blocks) before.
    ({"data": 1, "pipeline": 2, "tensor": 2}, True),
])
def test_a_model_is_traced_once_to_find_its_structure(traces, mesh,
                                                      pipeline):
  strategy = (tfpar.PipelineParallelStrategy(tfpar.Mesh(mesh),
                                             num_microbatches=2)
              if pipeline else tfpar.TensorParallelStrategy(
                  tfpar.Mesh(mesh)))
  with strategy.scope():
    model = tp_common.compile_model(tp_common.gpt())
  x, _ = tp_common.data("gpt", count=8)
  predictions = model.predict(x, batch_size=8, verbose=0)
  assert traces == ["gpt"]
  # Found from that one trace: both blocks' MLPs and attention split.
  layouts = {layout.layer.name: layout for layout in model._tfpar_layouts}  # pylint: disable=protected-access
  for block in range(tp_common.BLOCKS):
    assert f"block{block}_mlp_in" in layouts
    assert f"block{block}_mlp_out" in layouts
    assert f"block{block}_attention" in layouts
  reference = tp_common.gpt().predict(x, batch_size=8, verbose=0)
  np.testing.assert_allclose(predictions, reference, atol=1e-5)
