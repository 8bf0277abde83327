"""The notebooks' shared setup: project root, import path, quiet progress bars, the profile's folders.

nbval runs a notebook with its own folder as the working directory, papermill with the caller's, and a
reader may open it from anywhere under the checkout; so every notebook first puts the checkout's root
(the folder holding dvc.yaml) on ``sys.path`` -- one line, because this module cannot be imported
before that -- and then calls :func:`setup`::

    import sys; from pathlib import Path
    sys.path.insert(0, str(next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "dvc.yaml").exists())))
    from mapl.orchestration.notebook import setup
    nb = setup(profile)          # nb.root, nb.profile, nb.results, nb.notebooks, nb.tables, nb.figures, ...
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProfilePaths", "find_root", "profile_paths", "setup"]


@dataclass(frozen=True)
class ProfilePaths:
    """Where one profile's outputs live (profiles never write into each other's folders)."""
    root: Path
    profile: str

    @property
    def base(self) -> Path:
        return self.root / "reports" / self.profile

    @property
    def results(self) -> Path:                 # results/<group>/<run>.json
        return self.base / "results"

    @property
    def notebooks(self) -> Path:               # executed notebooks (papermill)
        return self.base / "notebooks"

    @property
    def tables(self) -> Path:
        return self.base / "tables"

    @property
    def figures(self) -> Path:
        return self.base / "figures"

    @property
    def metrics(self) -> Path:
        return self.base / "metrics.json"

    @property
    def checkpoints(self) -> Path:             # git-ignored
        return self.root / "checkpoints" / self.profile

    def group_results(self, group: str) -> Path:
        return self.results / group


def find_root(start: Path | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: the working directory) holding dvc.yaml."""
    start = Path(start or Path.cwd()).resolve()
    for p in (start, *start.parents):
        if (p / "dvc.yaml").exists():
            return p
    raise FileNotFoundError(f"no dvc.yaml in {start} or above: open the notebook inside a mapl checkout")


def profile_paths(profile: str, root: Path | None = None) -> ProfilePaths:
    return ProfilePaths(Path(root or find_root()), profile)


def setup(profile: str = "", root: Path | None = None) -> ProfilePaths:
    """Root first on ``sys.path`` (this checkout's mapl, whichever copy is installed), tqdm's
    "IProgress not found" warning off (no ipywidgets in the kernel),
    and the folders of ``profile`` (empty: params.yaml's ``profile:``)."""
    root = Path(root or find_root())
    if sys.path[0] != str(root):
        sys.path.insert(0, str(root))
    warnings.filterwarnings("ignore", message="IProgress not found")
    from ..core.config import load_params
    return ProfilePaths(root, profile or load_params(root / "params.yaml")["profile"])
