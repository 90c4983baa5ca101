"""tfpar's modules import each other in no cycle, counting imports made
inside functions and `importlib.import_module` of a literal name (issue
37: layers only point down: mesh <- engine <- parallelisms <- recipes,
planner, launch, CLI).

Read from the source with `ast`, nothing imported: `from P import N` is an
import of the module `P.N` when that is a file of the package, else of
`P` (its `__init__`).
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tfpar")


def _modules():
  """{module name: its path} of every tfpar module."""
  found = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(
            os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        found[".".join(parts)] = path
  return found


def _package(module, path):
  return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _imports(module, path, modules):
  """The tfpar modules `module` imports, wherever in its code."""
  tree = ast.parse(open(path).read(), path)
  named = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      named.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # Relative: from the module's package up.
        package = _package(module, path).split(".")
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
      for alias in node.names:
        child = f"{base}.{alias.name}"
        named.add(child if child in modules else base)
    elif (isinstance(node, ast.Call) and
          getattr(node.func, "attr", None) == "import_module" and
          node.args and isinstance(node.args[0], ast.Constant)):
      named.add(node.args[0].value)
  return {name for name in named if name in modules and name != module}


def _cycles(graph):
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in sorted(graph[node]):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = set()
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.add(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def _graph():
  modules = _modules()
  return {module: _imports(module, path, modules)
          for module, path in modules.items()}


def test_the_reader_sees_imports_inside_functions_and_importlib():
  # A cycle made only by a function-level import is found (so the check
  # below can fail): tfpar.mesh imported tfpar.tpu inside a method once.
  graph = {"a": {"b"}, "b": {"a"}, "c": set()}
  assert _cycles(graph) == [["a", "b"]]
  graph = _graph()
  assert "tfpar.keras_distribution" in graph["tfpar"]  # importlib, literal.
  assert "tfpar.engine.per_device.checks" in graph[
      "tfpar.engine.per_device.runs"]


def test_no_import_cycles():
  assert _cycles(_graph()) == []
