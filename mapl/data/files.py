"""sha256 of files and pinned downloads. Atomic writes and locks are ``mapl.base.io``'s (one implementation)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import DataError

__all__ = ["sha256_file", "sha256_fd", "check_sha256"]

_BLOCK = 1 << 22


def sha256_fd(fd: int, size: int | None = None) -> str:
    """sha256 of the first ``size`` bytes (default: all) of an open file, read with ``os.pread``."""
    h, offset = hashlib.sha256(), 0
    while size is None or offset < size:
        block = os.pread(fd, _BLOCK if size is None else min(_BLOCK, size - offset), offset)
        if not block:
            break
        h.update(block)
        offset += len(block)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def check_sha256(path: Path, expected: str, what: str) -> None:
    """Refuse a pinned download whose hash is not the pinned one."""
    actual = sha256_file(path)
    if actual != expected:
        raise DataError(f"{path}: sha256 mismatch for {what}: expected {expected}, got {actual}. "
                        f"The file is corrupt or not the pinned one; delete it and run again.")
