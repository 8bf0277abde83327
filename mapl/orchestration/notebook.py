"""The notebooks' shared setup: project root, import path, quiet progress bars, the profile's folders.

Every notebook first puts the checkout's root on ``sys.path`` (one line: nbval and papermill start it in other
folders), then calls ``nb = setup(profile)``.
"""
from __future__ import annotations

import ast
import math
import sys
import warnings
from pathlib import Path
from typing import Sequence

from ..base.settings import ConfigError, check_quantity

__all__ = ["NotebookParameterError", "ProfilePaths", "check_parameters", "find_root", "kernel_parameters", "setup"]

# papermill's injected cell starts with this comment (papermill.translators, comment="Parameters")
INJECTED_MARK = "# Parameters"


class ProfilePaths:
    """Where one profile's outputs live (profiles never write into each other's folders)."""

    def __init__(self, root: Path, profile: str):
        self.root, self.profile = Path(root), profile
        self.base = self.root / "reports" / profile
        self.results = self.base / "results"           # results/<group>/<run>.json
        self.notebooks = self.base / "notebooks"       # executed notebooks (papermill)
        self.tables = self.base / "tables"
        self.figures = self.base / "figures"


def find_root(start: Path | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: the working directory) holding dvc.yaml."""
    start = Path(start or Path.cwd()).resolve()
    for p in (start, *start.parents):
        if (p / "dvc.yaml").exists():
            return p
    raise FileNotFoundError(f"no dvc.yaml in {start} or above: open the notebook inside a mapl checkout")


class NotebookParameterError(ValueError):
    """A papermill parameter the notebook does not declare, or of another type than its default (one line in IPython)."""

    def _render_traceback_(self) -> list[str]:
        return [f"error: {self}"]


def _assigned(source: str) -> dict[str, ast.expr]:
    """The names a cell assigns at top level, with their value expressions (a parameters cell's defaults)."""
    out: dict[str, ast.expr] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out[node.target.id] = node.value
    return out


_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "True or False", "list": "a list",
          "dict": "a mapping"}


def _kind(value) -> str:
    """The type a parameter must keep: a number may be given as an int where the default is a float."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "int" if isinstance(value, int) else "float"
    return type(value).__name__


# notebook parameter -> the quantity of mapl.base.settings it is (the same rule as the CLI flag of that quantity)
NOTEBOOK_QUANTITIES = {"target_pct": "target_pct", "mfu": "mfu", "mfu_range": "mfu", "gpu_peak_tflops": "peak_tflops"}


def check_parameters(namespace: dict, history: Sequence[str]) -> frozenset[str]:
    """Hold papermill's injected parameters to the notebook's ``parameters`` cell (the cell before the injected one
    in ``history``): an undeclared name, another type, or a non-finite or negative number is refused naming it.
    Returns the names papermill set."""
    at = [i for i, src in enumerate(history) if src.lstrip().startswith(INJECTED_MARK)]
    if not at or at[-1] == 0:
        return frozenset()
    declared, given = _assigned(history[at[-1] - 1]), _assigned(history[at[-1]])
    for name in given:
        if name not in declared:
            raise NotebookParameterError(f"parameter {name!r} is not one of this notebook's: allowed "
                                         f"{', '.join(sorted(declared))} (its parameters cell)")
        try:
            default = ast.literal_eval(declared[name])
        except ValueError:                       # a default that is an expression: no type to hold it to
            continue
        value, want = namespace.get(name), _kind(default)
        if _kind(value) != want and not (want == "float" and _kind(value) == "int"):
            raise NotebookParameterError(f"parameter {name}={value!r} is invalid: must be {_WORDS.get(want, want)} like "
                                         f"its default {default!r}")
        if want in ("int", "float") and default >= 0 and not (math.isfinite(value) and value >= 0):
            raise NotebookParameterError(f"parameter {name}={value!r} is invalid: must be a finite number >= 0 "
                                         f"(its default is {default!r})")
        if name in NOTEBOOK_QUANTITIES:       # the CLI flag's own rule (mapl.base.settings.QUANTITIES)
            for item in value if isinstance(value, list) else [value]:
                try:
                    check_quantity(NOTEBOOK_QUANTITIES[name], item, f"parameter {name}=")
                except ConfigError as e:
                    raise NotebookParameterError(str(e)) from None
    return frozenset(given)


def kernel_parameters() -> tuple[dict, list[str]]:
    """The kernel's namespace and its executed cell sources (for :func:`check_parameters`); empty outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}, []
    ip = get_ipython()
    if ip is None:
        return {}, []
    return ip.user_ns, list(ip.history_manager.input_hist_raw)


def setup(profile: str = "", root: Path | None = None) -> ProfilePaths:
    """Papermill's parameters checked, root first on ``sys.path``, tqdm's IProgress warning off; the folders of
    ``profile`` (empty: params.yaml's ``profile:``)."""
    check_parameters(*kernel_parameters())
    root = Path(root or find_root())
    if sys.path[0] != str(root):
        sys.path.insert(0, str(root))
    warnings.filterwarnings("ignore", message="IProgress not found")
    from ..core.config import load_params
    params = load_params(root / "params.yaml")
    profile = profile or params["profile"]
    if profile not in params.get("profiles", {}):
        raise NotebookParameterError(f"parameter profile={profile!r} is invalid: allowed "
                                     f"{', '.join(params.get('profiles', {}))} (params.yaml)")
    return ProfilePaths(root, profile)
