"""The training-code fingerprint: which files change a run's numbers, and their hash.

Results record :func:`code_fingerprint` (provenance), the ranks of one run compare it before any work, and
dvc.yaml's train stages depend on the same folders.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from .config import PROJECT_ROOT

__all__ = ["TRAIN_SOURCES", "source_files", "code_fingerprint"]

# The folders whose content changes the numbers of a training run (the layers' rule: mapl/core holds
# whatever computes a number, mapl/data whatever decides the tokens; base, orchestration, planning, report
# and the entry points compute none). EXACTLY the train stage's deps in dvc.yaml besides the run's config and
# the data stamp (a test compares the two). A folder counts every file below it except __pycache__/ and
# *.pyc, which .dvcignore hides from DVC too. mapl/__init__.py carries the version the results record.
TRAIN_SOURCES = ("mapl/__init__.py", "mapl/core", "mapl/data", "pyproject.toml")


def source_files(root: str | Path = PROJECT_ROOT, sources=TRAIN_SOURCES) -> list[Path]:
    """Every file of ``sources`` under ``root``, sorted (folders expanded as DVC hashes them)."""
    root = Path(root)
    files = set()
    for entry in sources:
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


def code_fingerprint(root: str | Path = PROJECT_ROOT, sources=TRAIN_SOURCES) -> str:
    """sha256 over the training sources (relative paths and contents), first 16 hex digits: equal
    fingerprints mean the code that produced a checkpoint or result is the code that would now."""
    root = Path(root)
    h = hashlib.sha256()
    for path in source_files(root, sources):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
