"""The package's layers: imports point one way, no two modules import each other (directly or round a
longer circle), and the training fingerprint is the numerical layers.

    base < data < core < report < orchestration < planning < commands (mapl/cli)

* ``mapl/base``: I/O, the CLI error policy, typed config fields and their validator (no number).
* ``mapl/data``: corpus, tokenizer, batches (decides the tokens: fingerprinted).
* ``mapl/core``: whatever computes a number of a run (fingerprinted): config, model, compressors,
  optimizers, the loop, the runtime, the link and memory models a run reads. Inside it, ``mapl/core/runtime``
  (the multi-process pipeline) sits on top: no other core module imports it.
* ``mapl/report``: tables and figures from results JSON.
* ``mapl/orchestration``: params.yaml's runs, training them, progress, workspaces, launching.
* ``mapl/planning``: cost model, planner, peer systems (read results and orchestration's groups).
* ``mapl/cli``: the commands, ``mapl <name>`` (argparse and one call into a layer; argparse nowhere else).

A module may import its own layer or a lower one, at module level or inside a function; an import that
points up is a cycle waiting to happen and is listed with its file and line. Within a layer the imports
form no circle either (a circle is one module that cannot be read, tested or moved without the others):
every cycle is named with the file and line of each of its imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

from mapl.core.fingerprint import TRAIN_SOURCES

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["base", "data", "core", "report", "orchestration", "planning", "commands"]
PACKAGES = {"base": "base", "data": "data", "core": "core", "report": "report", "orchestration": "orchestration",
            "planning": "planning", "cli": "commands"}          # mapl/<folder> -> its layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    if module == "mapl":
        return LAYERS.index("base")               # the package's __init__: the version and the base layer's hook
    if len(parts) >= 2 and parts[1] in PACKAGES:
        return LAYERS.index(PACKAGES[parts[1]])
    raise AssertionError(f"{module} is in no layer: put it under one of mapl/{{{','.join(PACKAGES)}}}")


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


def argparse_imports(paths) -> list[str]:
    """'file:line' of every argparse import among ``paths``."""
    return [f"{path.relative_to(ROOT)}:{line}" for path in paths for line, target in imports(path)
            if target.split(".")[0] == "argparse"]


def test_only_the_commands_parse_arguments():
    """argparse lives in mapl/cli alone: a library module keeps plain functions, its command the parser and one
    call (a library `main` is a second command line beside `mapl <name>`, with its own help and errors)."""
    outside = [p for p in package_files() if p.relative_to(ROOT / "mapl").parts[0] != "cli"]
    assert argparse_imports(outside) == [], "argparse outside mapl/cli: move the parser into mapl/cli/<command>.py"
    assert argparse_imports([ROOT / "mapl" / "cli" / "data.py"]), "the check finds an argparse import"


def test_the_core_does_not_reach_into_its_runtime():
    """mapl/core/runtime is the multi-process pipeline on top of the core: the core's other modules (config, link,
    memory, the single-process engine) import none of it; what both use (the schedules, the boundary's per-step
    state) sits in the core beside them."""
    runtime = ROOT / "mapl" / "core" / "runtime"
    inward = [f"{path.relative_to(ROOT)}:{line} imports {target}" for path in package_files()
              if path.is_relative_to(ROOT / "mapl" / "core") and not path.is_relative_to(runtime)
              for line, target in imports(path) if target.startswith("mapl.core.runtime")]
    assert inward == [], "core modules that import the runtime (move what they use out of it):\n" + "\n".join(inward)
    worker = {t for _, t in imports(runtime / "worker.py")}
    assert "mapl.core.schedule" in worker and "mapl.core.boundary_sync" in worker      # the check sees these imports


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


# ---- import cycles ------------------------------------------------------------------------------------------
def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported mapl module: 'file:line' of the first such import}, every import counted
    (module level and inside functions; ``from m import f`` is an import of m)."""
    graph = {}
    for path in package_files():
        module = module_name(path)
        edges = graph.setdefault(module, {})
        for line, target in imports(path):
            while target.startswith("mapl") and not _is_module(target):    # an attribute of a mapl module
                target = target.rpartition(".")[0]
            if target.startswith("mapl") and target != module:
                edges.setdefault(target, f"{path.relative_to(ROOT)}:{line}")
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """The strongly connected sets of two or more modules: each module of one reaches every other."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):                                   # Tarjan's algorithm; the package is a few hundred modules
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(members)
    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def find_cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of every circle, as 'a -> b -> a (file:line, file:line)'."""
    return sorted(_one_cycle(graph, min(members), members) for members in circles(graph))


def _one_cycle(graph: dict[str, dict[str, str]], start: str, members: set[str]) -> str:
    """The shortest path from ``start`` back to itself inside ``members`` (breadth first)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]]):
            if w == start:
                cycle = path + [start]
                where = ", ".join(graph[a][b] for a, b in zip(cycle, cycle[1:]))
                return f"{' -> '.join(cycle)} ({where})"
            if w in members and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"{start} is on no cycle of {sorted(members)}")


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert cycles == [], "modules that import each other (move what they share into a module below both):\n" + \
        "\n".join(cycles)


def test_the_cycle_finder_names_a_cycle():
    """A circle of three, a separate pair and an edge into a circle (which is on none)."""
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:2"}, "c": {"a": "c.py:3", "d": "c.py:4"}, "d": {},
             "e": {"f": "e.py:5", "a": "e.py:6"}, "f": {"e": "f.py:7"}}
    assert find_cycles(graph) == ["a -> b -> c -> a (a.py:1, b.py:2, c.py:3)", "e -> f -> e (e.py:5, f.py:7)"]
    del graph["c"]["a"]
    assert find_cycles(graph) == ["e -> f -> e (e.py:5, f.py:7)"]


def test_the_engine_and_the_memory_plan_do_not_import_each_other():
    """The memory plan builds a stage's optimizers from mapl.core.optimizer_recipe, below the engine."""
    graph = import_graph()
    assert "mapl.core.memory" in graph["mapl.core.engine"]
    assert "mapl.core.engine" not in graph["mapl.core.memory"]
    assert "mapl.core.optimizer_recipe" in graph["mapl.core.memory"]


def test_the_runs_sit_below_the_sweep_and_the_validator():
    """params.yaml's runs are read in mapl.orchestration.groups, which imports none of the modules that read them;
    params.yaml's validation (it reads the frozen-trunk study too) sits above them all."""
    graph = import_graph()
    for reader in ("sweep", "validate", "rescore", "ladder"):
        assert "mapl.orchestration.groups" in graph[f"mapl.orchestration.{reader}"], reader
    below = {m for m in graph["mapl.orchestration.groups"] if m.startswith("mapl.orchestration.")}
    assert below == set(), below
    assert "mapl.orchestration.frozen_trunk" in graph["mapl.orchestration.validate"]
    assert "mapl.orchestration.frozen_trunk" not in graph["mapl.orchestration.sweep"]
