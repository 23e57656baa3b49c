"""The package's layout rules: no import circle (direct or through other modules, imports inside
functions included), no module over 400 lines, no function over 100, package `__init__` files
that import nothing (so that importing one module never drags in its siblings), and a library
that never imports the benchmarks (`benchmarks/`, outside the package, measures it). The
benchmarks follow the same rules. Stages import only earlier ones: the decoding library knows
nothing of configs, runs or training; a run's directory nothing of training, evaluation or
serving; constraints (`sbd_jax.constrain`) nothing of models, decoding or what uses them."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = (REPO / "sbd_jax", REPO / "benchmarks")
MAX_LINES = 400
MAX_FUNCTION_LINES = 100


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for package in PACKAGES for p in package.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The package modules `name` imports anywhere in its source."""
  is_package = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
        base = ".".join(parent + ([node.module] if node.module else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    for target in targets:
      while target and target not in modules:  # an attribute of a module: the module
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle of `graph`, or None (depth-first search, colours)."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_the_cycle_finder_finds_direct_and_indirect_circles():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
  assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_no_import_circle():
  graph = _graph()
  assert "sbd_jax.decode.loop" in graph and graph["sbd_jax.decode.loop"]  # the walk sees imports
  circle = _cycle(graph)
  assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_library_never_imports_the_benchmarks():
  graph = _graph()
  assert "benchmarks.report" in graph and "sbd_jax.decode.loop" in graph
  reaching = {
    name: sorted(m for m in imports if m.split(".")[0] == "benchmarks")
    for name, imports in graph.items()
    if name.startswith("sbd_jax")
  }
  assert not {name: m for name, m in reaching.items() if m}


# A stage and what it must not import (later stages).
LATER_STAGES = {
  "sbd_jax.decode": ("sbd_jax.config", "sbd_jax.run", "sbd_jax.training", "sbd_jax.evals",
                     "sbd_jax.serving", "sbd_jax.hf"),
  "sbd_jax.run": ("sbd_jax.training", "sbd_jax.evals", "sbd_jax.serving", "sbd_jax.hf"),
  "sbd_jax.constrain": ("sbd_jax.config", "sbd_jax.run", "sbd_jax.training", "sbd_jax.evals",
                        "sbd_jax.serving", "sbd_jax.hf", "sbd_jax.decode", "sbd_jax.model"),
  "sbd_jax.training": ("sbd_jax.evals", "sbd_jax.serving", "sbd_jax.hf"),
}  # fmt: skip


def test_no_stage_imports_a_later_one():
  graph = _graph()
  wrong = {
    name: sorted(m for m in imports if m.startswith(LATER_STAGES[stage]))
    for name, imports in graph.items()
    for stage in LATER_STAGES
    if name == stage or name.startswith(stage + ".")
  }
  assert not {name: m for name, m in wrong.items() if m}


def test_no_module_over_the_line_limit():
  long = {
    name: n
    for name, path in _modules().items()
    if (n := len(path.read_text().splitlines())) > MAX_LINES
  }
  assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_function_over_the_line_limit():
  long = {
    f"{name}.{node.name}": n
    for name, path in _modules().items()
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
  }
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_package_inits_import_nothing():
  for name, path in _modules().items():
    if path.name == "__init__.py":
      body = ast.parse(path.read_text()).body
      assert all(isinstance(n, ast.Expr) for n in body), f"{name}/__init__.py imports or defines"
