"""`PerDeviceExtended`: the `StrategyExtended` base of every strategy whose
replicas are tensor groups run once per device (SPMD): tensor parallelism,
the pipeline's tensor-parallel stages, expert x tensor.

What it gathers, each in its own module:

* `runs.PerDeviceRuns`: `_call_for_each_replica` traces the replica
  function once per device of every group, and per-device results leave
  as per-replica ones (each group's first device's);
* `spmd_run.DeviceReplicaIds`: each trace's replica id selects its
  device's component of a variable;
* `zero_hooks.ZeroHooks`: what `tfpar.ZeRO` asks of such a strategy (the
  devices of a column, sums over a column);
* `reductions.PerDeviceReductions`: gradients all-reduced over the data
  replicas within each device column;
* keras-hub's `CausalLM.generate`, whose split layers cannot run outside
  the replicas: `register_model` hooks it (`_compat/keras_hub_generate.py`)
  and each subclass's `generate_function` runs it per device
  (`tensor_parallel/spmd/generation.py`).

A subclass sets `self._groups` (`collectives.TensorGroups`) and
`self._first_replica` in its `__init__`, and gives `tensor_size`,
`partial_weights` and `_clear_memos`.
"""

from tfpar._compat import keras_hub_generate
from tfpar._compat import keras_trainer
from tfpar._compat import spmd_run
from tfpar.common import strategy_hooks
from tfpar.engine import extended as engine_extended
from tfpar.engine.per_device import reductions
from tfpar.engine.per_device import runs
from tfpar.engine.per_device import zero_hooks


class PerDeviceExtended(runs.PerDeviceRuns,
                        spmd_run.DeviceReplicaIds,
                        zero_hooks.ZeroHooks,
                        reductions.PerDeviceReductions,
                        engine_extended.MeshExtended):
  """A `MeshExtended` whose replicas run once per device of their tensor
  group (arguments as `MeshExtended`'s)."""

  def register_model(self, model):
    super().register_model(model)
    if keras_hub_generate.is_causal_lm(model):
      keras_hub_generate.install(_generate_function_of)


def _generate_function_of(model):
  """The generate function of `model`'s strategy (None: keras-hub's)."""
  return strategy_hooks.of(keras_trainer.model_strategy(model)
                           ).generate_function(model)
