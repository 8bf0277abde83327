"""What the lent GPU machine offers at import time, enforced wherever a loan's phases run (CPU rehearsal too).

The first GPU machine has Python 3.12 and torch 2.11 (CUDA 13) with numpy, yaml, tqdm, accelerate and
matplotlib, and nothing can be installed there: not ``datasets``, ``tokenizers``, ``dvc``, ``papermill``
or the rest of the project's dependencies. :func:`install` puts an import hook first on
``sys.meta_path`` that refuses, with one line naming the importing file, any import *made by the
project's own code* (a file under this repository) of a third-party module beyond :data:`ON_DEVICE`.
Imports made by the libraries themselves (torch's optional ones) are left alone: the device has what
its torch needs.

    python benchmarks/loan_guard.py SCRIPT [ARGS...]     # run SCRIPT as __main__ with the hook installed

The refused names are the project's: every top-level module its code imports (``mapl/``,
``benchmarks/``) and every dependency ``pyproject.toml`` declares, less the standard library, the
project's own modules and :data:`ON_DEVICE`.
"""
from __future__ import annotations

import ast
import functools
import importlib.abc
import os
import runpy
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ON_DEVICE", "ABSENT_ENV", "absent_modules", "install", "LoanImportGuard"]

ON_DEVICE = frozenset({"torch", "numpy", "yaml", "tqdm", "accelerate", "matplotlib"})
_IMPORT_NAMES = {"pyyaml": "yaml"}                   # distributions whose import name is not their own
ABSENT_ENV = "MAPL_LOAN_ABSENT"


def _declared(root: Path) -> set[str]:
    """Import names of every dependency pyproject.toml declares (main and optional)."""
    meta = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    specs = list(meta.get("dependencies", [])) + [d for group in meta.get("optional-dependencies", {}).values()
                                                  for d in group]
    names = set()
    for spec in specs:
        dist = spec.split(";")[0].split("[")[0]
        for sep in "=<>!~ ":
            dist = dist.split(sep)[0]
        dist = dist.strip().lower()
        names.add(_IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return names


def _imported(root: Path) -> set[str]:
    """Top-level names the project's code imports anywhere (module or function level)."""
    names = set()
    for path in [*root.joinpath("mapl").rglob("*.py"), *root.joinpath("benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@functools.lru_cache(maxsize=None)
def absent_modules(root: Path = ROOT) -> frozenset[str]:
    """The third-party modules the project knows of that the GPU machine does not have (a parent hands its
    answer to its children in ``MAPL_LOAN_ABSENT``: the scan reads every source file)."""
    if root == ROOT and os.environ.get(ABSENT_ENV):
        return frozenset(os.environ[ABSENT_ENV].split(","))
    own = {"mapl", *(p.stem for p in root.joinpath("benchmarks").glob("*.py"))}
    known = _declared(root) | _imported(root)
    return frozenset(known - set(sys.stdlib_module_names) - own - ON_DEVICE)


class LoanImportGuard(importlib.abc.MetaPathFinder):
    """Refuses an import of an absent module when the importing frame's file lies in the repository."""

    def __init__(self, absent: frozenset[str], root: Path = ROOT):
        self.absent, self.root = absent, str(root) + "/"
        self.venv = str(root / ".venv") + "/"

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in self.absent:
            return None
        where = self._importer()
        if where is None:
            return None                                  # a library's own import: the device has its deps
        raise ImportError(f"{fullname} is not on the GPU machine (imported by {where}); the loan's code may use "
                          f"only {', '.join(sorted(ON_DEVICE))} beyond the standard library")

    def _importer(self) -> str | None:
        """'file:line' of the innermost frame outside the import machinery, if it is the project's code."""
        frame = sys._getframe(2)
        while frame is not None and ("importlib" in frame.f_code.co_filename or frame.f_code.co_filename ==
                                     __file__):
            frame = frame.f_back
        if frame is None:
            return None
        file = frame.f_code.co_filename
        if file.startswith(self.root) and not file.startswith(self.venv):
            return f"{Path(file).relative_to(self.root)}:{frame.f_lineno}"
        return None


def install(root: Path = ROOT) -> LoanImportGuard:
    """Put the guard first on ``sys.meta_path`` (once) and return it."""
    for finder in sys.meta_path:
        if isinstance(finder, LoanImportGuard):
            return finder
    guard = LoanImportGuard(absent_modules(root), root)
    sys.meta_path.insert(0, guard)
    return guard


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` (its arguments after it) with the guard installed."""
    if not argv:
        sys.stderr.write("usage: python benchmarks/loan_guard.py SCRIPT [ARGS...]\n")
        raise SystemExit(2)        # a usage error (argparse's code); 1 is a bug
    install()
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
