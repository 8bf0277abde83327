"""Small file helpers: sha256 of a file, atomic writes, an exclusive lock with the holder's PID."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

from .errors import DataError

__all__ = ["sha256_file", "sha256_fd", "check_sha256", "atomic_write_bytes", "atomic_write_json", "exclusive_lock"]

log = logging.getLogger("mapl.data")

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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write next to the target under a name unique to this process, then rename: readers never see
    a half-written file, and two writers never share a temp file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


@contextlib.contextmanager
def exclusive_lock(path: Path, what: str) -> Iterator[None]:
    """Hold ``flock(path)``; a second process waits (saying who holds it) instead of racing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            log.info("waiting for PID %s, which is %s", holder, what)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)             # releases the lock
