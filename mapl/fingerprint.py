"""The fingerprint of the training code: equal fingerprints mean the code that produced a checkpoint
is the code that would resume it (``notebooks/train.ipynb`` drops a group's checkpoints when it
changes).

    >>> code_fingerprint(PROJECT_ROOT)          # 16 hex digits
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

__all__ = ["TRAIN_SOURCES", "code_fingerprint"]

# Files whose content changes the numbers of a training run; dvc.yaml's train deps list the same.
TRAIN_SOURCES = ("mapl/__init__.py", "mapl/config.py", "mapl/data/*.py", "mapl/model.py", "mapl/stages.py",
                 "mapl/optim.py", "mapl/wire.py", "mapl/diagnostics.py", "mapl/train.py", "mapl/sweep.py",
                 "mapl/compress/*.py", "pyproject.toml")


def code_fingerprint(root: str | Path, patterns: Sequence[str] = TRAIN_SOURCES) -> str:
    """sha256 over the training sources (paths and contents, sorted), first 16 hex digits."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()}):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
