"""tfpar: tensor, pipeline and ZeRO parallelism for TensorFlow / Keras 3.

Public names are loaded on first use, so `tfpar launch` starts without
importing TensorFlow.

Example:

>>> import tfpar
>>> strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": -1}))
"""

import importlib
import sys
import warnings

__version__ = "0.1.0"

_EXPORTS = {
    "BackupAndRestore": "tfpar.callbacks",
    "ClusterLayout": "tfpar.cluster",
    "DataParallelStrategy": "tfpar.data_parallel",
    "ExpertParallelStrategy": "tfpar.expert_parallel",
    "Mesh": "tfpar.mesh",
    "MeshAxis": "tfpar.mesh_axes",
    "ModelCheckpoint": "tfpar.callbacks",
    "MoE": "tfpar.expert_parallel.moe_layer",
    "PipelineParallelStrategy": "tfpar.pipeline",
    "PipelineTrace": "tfpar.pipeline",
    "configure_virtual_cpus": "tfpar.local_devices",
    "from_keras_distribution": "tfpar.keras_distribution",
    "from_recipe": "tfpar.recipes",
    "keep_global_batch": "tfpar.global_batch",
    "ColumnParallel": "tfpar.tensor_parallel",
    "CommunicationLog": "tfpar.tensor_parallel",
    "Replicate": "tfpar.tensor_parallel",
    "RowParallel": "tfpar.tensor_parallel",
    "ShardedWeight": "tfpar.tensor_parallel",
    "ShardingPlan": "tfpar.tensor_parallel",
    "TrainingMonitor": "tfpar.monitor",
    "TensorParallelStrategy": "tfpar.tensor_parallel",
    "VocabParallel": "tfpar.tensor_parallel",
    "logical_weights": "tfpar.tensor_parallel",
    "memory_report": "tfpar.memory",
    "plan_layout": "tfpar.planner",
    "save_weights": "tfpar.callbacks",
    "ZeRO": "tfpar.zero",
}
# Namespaces users reach into (`tfpar.tpu.describe`, `tfpar.recipes.find`).
_PUBLIC_SUBMODULES = ("expert_parallel", "pipeline", "planner", "recipes", "tensor_parallel",
                      "tpu", "zero")
# Implementation modules: importable as `tfpar.X`, but not tfpar's API.
_INTERNAL_SUBMODULES = ("cluster", "engine", "launch", "local_devices",
                        "mesh", "preemption")
# Old names kept working for a while: {old: (new, module)}.
_DEPRECATED = {"plan": ("plan_layout", "tfpar.planner")}

__all__ = sorted(_EXPORTS) + list(_PUBLIC_SUBMODULES)


def __getattr__(name):
  if name in _EXPORTS:
    module = importlib.import_module(_EXPORTS[name])
    return getattr(module, "plan" if name == "plan_layout" else name)
  if name in _DEPRECATED:
    new_name, module = _DEPRECATED[name]
    warnings.warn(
        f"tfpar.{name} is renamed tfpar.{new_name} (so that it is not "
        f"mistaken for the plan= argument, which takes a ShardingPlan); "
        f"tfpar.{name} will be removed.", DeprecationWarning, stacklevel=2)
    return importlib.import_module(module).plan
  if name in _PUBLIC_SUBMODULES + _INTERNAL_SUBMODULES:
    return importlib.import_module(f"tfpar.{name}")
  raise AttributeError(f"module 'tfpar' has no attribute {name!r}")


def __dir__():
  return __all__


# tfpar.ZeRO must shard an optimizer before `fit` builds it, so `fit` must be
# hooked before user code looks it up, and `keras.distribution.set_distribution`
# (a no-op on TensorFlow) made to set tfpar's strategy. Without importing
# Keras here (the `tfpar` command starts without TensorFlow): hook now if
# Keras is loaded, else as soon as it is imported.


class _HookKerasOnImport:
  """A `sys.meta_path` finder that installs tfpar's Keras hooks right after
  `keras` is imported, then leaves `sys.meta_path`. (TensorFlow looks
  `keras` up without importing it: every spec found gets the hook.)"""

  def find_spec(self, name, path=None, target=None):
    if name != "keras":
      return None
    for finder in sys.meta_path:
      find = getattr(finder, "find_spec", None)
      spec = (None if finder is self or find is None
              else find(name, path, target))
      if spec is not None:
        break
    loader = getattr(spec, "loader", None)
    execute = getattr(loader, "exec_module", None)
    if execute is None or isinstance(loader, type):  # A shared loader.
      return spec

    def exec_module(module):
      execute(module)
      if self in sys.meta_path:
        sys.meta_path.remove(self)
      _install_keras_hooks()

    loader.exec_module = exec_module
    return spec


def _install_keras_hooks():
  importlib.import_module("tfpar.keras_hooks").install_fit_preparation()
  importlib.import_module(
      "tfpar.keras_distribution").install_set_distribution()


if "keras" in sys.modules:
  _install_keras_hooks()
elif not any(isinstance(f, _HookKerasOnImport) for f in sys.meta_path):
  sys.meta_path.insert(0, _HookKerasOnImport())
