"""The package's layers: imports point one way, and the training fingerprint is the numerical layers.

    base < data < core < report < orchestration < planning < commands

* ``mapl/base``: I/O, the CLI error policy, typed config fields and their validator (no number).
* ``mapl/data``: corpus, tokenizer, batches (decides the tokens: fingerprinted).
* ``mapl/core``: whatever computes a number of a run (fingerprinted): config, model, compressors,
  optimizers, the loop, the runtime, the link and memory models a run reads.
* ``mapl/report``: tables and figures from results JSON.
* ``mapl/orchestration``: run groups, reuse, progress, workspaces, launching.
* ``mapl/planning``: cost model, planner, peer systems (read results and orchestration's groups).
* commands: ``python -m mapl.<name>`` modules (argparse and one call), and the data package's CLI.

A module may import its own layer or a lower one, at module level or inside a function; an import that
points up is a cycle waiting to happen and is listed with its file and line.
"""
from __future__ import annotations

import ast
from pathlib import Path

from mapl.core.fingerprint import TRAIN_SOURCES

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["base", "data", "core", "report", "orchestration", "planning", "commands"]
COMMANDS = {"mapl.train", "mapl.pipeline", "mapl.sweep", "mapl.frozen_trunk", "mapl.workspace", "mapl.costmodel", "mapl.planner",
            "mapl.peer", "mapl.reuse", "mapl.memory", "mapl.data.cli", "mapl.data.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    if module in COMMANDS:
        return LAYERS.index("commands")
    parts = module.split(".")
    if module == "mapl":
        return LAYERS.index("base")               # the package's __init__: the version, no imports
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    raise AssertionError(f"{module} is in no layer: put it under one of mapl/{{{','.join(LAYERS[:-1])}}} "
                         "or make it a command")


def imports(path: Path):
    """(line, imported module) for every mapl import of the file, relative ones resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            for name in names:       # `from . import x` imports module x; `from .m import f` imports m
                yield node.lineno, name if _is_module(name) else target
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def package_files():
    return sorted(p for p in (ROOT / "mapl").rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_in_a_layer():
    for path in package_files():
        layer(module_name(path))


def test_imports_point_down():
    upward = []
    for path in package_files():
        mine = layer(module_name(path))
        for line, target in imports(path):
            if target.startswith("mapl") and layer(target) > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine]}) imports {target} "
                              f"({LAYERS[layer(target)]})")
    assert upward == [], "imports that point up a layer:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk resolves relative imports, function-level ones included (a checker that cannot fail is none)."""
    core = ROOT / "mapl" / "core" / "engine.py"
    found = {t for _, t in imports(core)}
    assert "mapl.core.config" in found and "mapl.core.loop" in found
    assert layer("mapl.orchestration.sweep") > layer("mapl.core.engine")
    assert "mapl.core.memory" in {t for _, t in imports(ROOT / "mapl" / "core" / "runtime" / "rank.py")}


def test_the_fingerprint_is_the_numerical_layers():
    """The training fingerprint (and dvc.yaml's train deps, held equal in test_notebooks.py) is the layers
    that compute numbers: a docstring edit in orchestration, planning, report or a command retrains nothing."""
    assert TRAIN_SOURCES == ("mapl/__init__.py", "mapl/core", "mapl/data", "pyproject.toml")


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (module level or inside a function), for every module of it."""
    graph: dict[str, set[str]] = {}
    for path in package_files():
        name = module_name(path)
        if name.startswith(package + "."):
            graph[name] = {t for _, t in imports(path) if t.startswith(package + ".") and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each group of modules that reach one another (sorted), Tarjan's algorithm."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_orchestration_imports_point_one_way():
    """Inside orchestration every import points one way (groups at the bottom; reuse, refresh, the sweep, the
    frozen-trunk study and the validator above it): a cycle would make the order of imports decide what works."""
    found = cycles(import_graph("mapl.orchestration"))
    assert found == [], "import cycles inside mapl/orchestration:\n" + "\n".join(" <-> ".join(c) for c in found)
