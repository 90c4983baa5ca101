"""The fence around Keras and TensorFlow internals (docs/design.md).

Only `tfpar/_compat/` may import `keras.src`, `tensorflow.python` or
TensorFlow's protos, read or write a private attribute of an object that
is not its own (`x._name` where `x` is not `self`/`cls`, or the same
through `getattr`/`hasattr`/`setattr`/`object.__setattr__` with a literal
name), or override a private method of a Keras or TensorFlow class.
Exceptions, each one of TensorFlow's designed extension points:
`StrategyExtended` hooks in strategy subclasses and `Trackable`'s saving
hooks, listed below. Marks tfpar sets on objects (`_tfpar_*`) are tfpar's
own.
"""

import ast
import importlib
import inspect
import pathlib
import pkgutil

import keras
import pytest
import tensorflow as tf

import tfpar
from tfpar import _compat
from tfpar._compat import keras_layers
from tfpar._compat.tf_modules import collective_all_reduce_strategy
from tfpar._compat.tf_modules import trackable_base

ROOT = pathlib.Path(tfpar.__file__).parent
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core",
                   "tensorflow.compiler", "tsl")
# TensorFlow's extension points for strategies and checkpointable objects.
EXTENSION_POINTS = {
    "_create_variable", "_call_for_each_replica", "_reduce_to",
    "_batch_reduce_to", "_experimental_distribute_dataset",
    "_validate_colocate_with_variable", "_initialize_local_devices",
    "_use_merge_call", "_replica_ctx_all_reduce", "_gather_to_implementation",
    "_serialize_to_tensors", "_restore_from_tensors"}
_ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr", "delattr", "__setattr__"}


def _outside_fence():
  return sorted(p for p in ROOT.rglob("*.py")
                if "_compat" not in p.relative_to(ROOT).parts)


def _is_private(name):
  return (name.startswith("_") and not name.startswith("__")
          and not name.startswith("_tfpar"))


def _first_parameters(tree):
  """{id of a node: first parameters of the functions it is in}."""
  first = {}
  for function in ast.walk(tree):
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef,
                             ast.Lambda)):
      arguments = function.args.posonlyargs + function.args.args
      if arguments:
        for node in ast.walk(function):
          first.setdefault(id(node), set()).add(arguments[0].arg)
  return first


def _is_own(owner, node, first):
  """`self.x` / `cls.x` in a method of that object, or `super().x`."""
  if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
    return owner.id in first.get(id(node), ())
  return (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
          and owner.func.id == "super")


def _violations(path):
  tree = ast.parse(path.read_text())
  first = _first_parameters(tree)
  slots = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
           and any(getattr(t, "id", None) == "__slots__" for t in n.targets)}
  found = []
  for node in ast.walk(tree):
    where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 0)}"
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""])
      found += [f"{where} imports {n}" for n in names
                if n.startswith(PRIVATE_MODULES)]
    elif isinstance(node, ast.Attribute) and _is_private(node.attr):
      if _is_own(node.value, node, first):
        continue
      if ast.unparse(node) == "os._exit":  # The documented way to exit now.
        continue
      found.append(f"{where} touches {ast.unparse(node)}")
    elif isinstance(node, ast.Call):
      function = node.func
      called = (function.id if isinstance(function, ast.Name) else
                function.attr if isinstance(function, ast.Attribute) else "")
      if called in _ATTRIBUTE_CALLS and len(node.args) > 1:
        name, owner = node.args[1], node.args[0]
        if (isinstance(name, ast.Constant) and isinstance(name.value, str)
            and _is_private(name.value) and not _is_own(owner, node, first)):
          found.append(f"{where} {called}(..., {name.value!r})")
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and (
        id(node) not in slots):
      # Names handed to a helper that looks them up (a table of names).
      for element in node.elts:
        if (isinstance(element, ast.Constant) and
            isinstance(element.value, str) and _is_private(element.value)
            and element.value.isidentifier()):
          found.append(f"{where} names {element.value!r}")
  return found


def test_only_the_fence_touches_keras_and_tensorflow_internals():
  violations = [v for path in _outside_fence() for v in _violations(path)]
  assert not violations, "\n".join(violations)


def test_the_scan_finds_what_it_forbids(tmp_path):
  sample = tmp_path / "sample.py"
  sample.write_text(
      "from keras.src import backend\n"
      "x = layer._trainable_variables\n"
      "y = getattr(model, '_distribute_strategy', None)\n"
      "class C:\n  def m(self):\n    return self._own + layer._tfpar_mark\n"
      "def f(cls):\n  return cls._fine\n"
      "def g(x):\n  cls = x\n  return cls._not_fine\n"
      "names = ('_backend_apply_gradients',)\n")
  original = globals()["ROOT"]
  globals()["ROOT"] = tmp_path
  try:
    found = _violations(sample)
  finally:
    globals()["ROOT"] = original
  assert len(found) == 5, found


def _tfpar_classes():
  classes = {}
  for info in pkgutil.walk_packages(tfpar.__path__, "tfpar."):
    if info.name.startswith("tfpar._compat") or info.name.endswith(
        "__main__"):
      continue
    module = importlib.import_module(info.name)
    for value in vars(module).values():
      if inspect.isclass(value) and value.__module__ == info.name:
        classes[value] = None
  return list(classes)


# Keras and TensorFlow classes whose private methods a tfpar class could
# override, mixin or not.
_FOREIGN_BASES = (
    keras.layers.Layer, keras.Variable, keras.optimizers.Optimizer,
    keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore,
    keras.Model, tf.Variable, trackable_base.Trackable,
    tf.distribute.MultiWorkerMirroredStrategy,
    collective_all_reduce_strategy.CollectiveAllReduceExtended)


def _foreign_private_names():
  """Private names defined by those classes or any of their bases (the
  strategy's MRO covers Strategy, the extended's covers MirroredExtended
  and StrategyExtendedV2)."""
  return {name for base in _FOREIGN_BASES for cls in base.__mro__
          for name in vars(cls) if _is_private(name)}


def test_no_class_overrides_a_private_keras_or_tf_method():
  foreign = _foreign_private_names()
  overrides = []
  for cls in _tfpar_classes():
    for name in vars(cls):
      if name in foreign and name not in EXTENSION_POINTS:
        overrides.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
  assert not overrides, overrides


def test_an_accessor_fails_loudly_when_keras_moved_something():
  layer = keras.layers.Dense(2)
  del layer._trainable_variables  # What a Keras upgrade could do.
  with pytest.raises(_compat.Incompatible, match="_trainable_variables"):
    keras_layers.own_variables(layer)


def test_a_model_without_its_strategy_attribute_is_an_error():
  from tfpar._compat import keras_trainer  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  keras_trainer.model_strategy(model)  # Keras recorded it (None here).
  del model._distribute_strategy
  with pytest.raises(_compat.Incompatible, match="_distribute_strategy"):
    keras_trainer.model_strategy(model)
