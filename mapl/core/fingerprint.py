"""The training-code fingerprint: the files that change a run's numbers, and their hash (ranks compare it)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from .config import PROJECT_ROOT

__all__ = ["TRAIN_SOURCES", "source_files", "code_fingerprint"]

# What changes a run's numbers (mapl/core computes, mapl/data decides the tokens): EXACTLY the train stage's code
# deps in dvc.yaml (a test compares them); a folder counts every file but __pycache__/ and *.pyc (.dvcignore).
TRAIN_SOURCES = ("mapl/__init__.py", "mapl/core", "mapl/data", "pyproject.toml")


def source_files(root: str | Path = PROJECT_ROOT) -> list[Path]:
    """Every file of the training sources under ``root``, sorted."""
    root = Path(root)
    files = set()
    for entry in TRAIN_SOURCES:
        path = root / entry
        if path.is_dir():
            files.update(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                         and p.suffix != ".pyc")
        elif path.is_file():
            files.add(path)
        else:
            raise FileNotFoundError(f"training source {entry} is missing under {root}; mapl.core.fingerprint.TRAIN_SOURCES "
                                    "and dvc.yaml's train deps must list files that exist")
    return sorted(files)


def code_fingerprint(root: str | Path = PROJECT_ROOT) -> str:
    """sha256 over the training sources' relative paths and contents, 16 hex digits."""
    root = Path(root)
    h = hashlib.sha256()
    for path in source_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
