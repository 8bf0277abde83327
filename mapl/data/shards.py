"""Token shards: flat files of little-endian token ids (uint16, uint32 above 65536 ids), each document followed
by the end-of-text id. The writer hashes as it writes and can resume; the reader uses ``os.pread``, not a memory
map, so a shard truncated while a run reads it is a one-line error instead of a SIGBUS (docs/data.md).
"""
from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import numpy as np

from .config import DataError, prepare_command

__all__ = ["dtype_for", "ShardWriter", "TokenShard"]

_MAX_NAMES = 1000          # list document names in the manifest for small corpora only (works, files)
_READ_PIECE = 1 << 28      # bytes per pread call for large reads (Linux caps one call below 2 GiB)


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class ShardWriter:
    """Appends whole documents to one shard file, hashing as it goes. ``resume`` (a :meth:`sync` state) continues
    a file: the bytes it vouches for are kept and re-hashed, anything after them (an interrupted chunk) cut off."""

    def __init__(self, path: Path, dtype: np.dtype, resume: dict | None = None):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.h = hashlib.sha256()
        self.tokens = self.docs = 0
        self.names: list[str] = []
        if resume:
            self.f = open(self.path, "r+b")
            self.f.truncate(resume["tokens"] * self.dtype.itemsize)      # its length was checked (stream._resumable)
            self.h = hashlib.file_digest(self.f, "sha256")          # reads to the end: writes append
            self.tokens, self.docs, self.names = resume["tokens"], resume["documents"], list(resume["names"])
        else:
            self.f = open(self.path, "wb")

    def write(self, name: str, ids: np.ndarray, cap: int = 0) -> bool:
        """Append one document; with ``cap`` > 0 the one that reaches it is cut so the shard holds exactly ``cap``
        tokens. True when the cap is reached."""
        full = cap > 0 and self.tokens + len(ids) >= cap
        if full:
            ids = ids[: cap - self.tokens]
        b = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self.f.write(b)
        self.h.update(b)
        self.tokens += len(ids)
        self.docs += 1
        if len(self.names) <= _MAX_NAMES:
            self.names.append(name)
        return full

    def sync(self) -> dict:
        """Flush to disk; the returned state resumes exactly here."""
        self.f.flush()
        os.fsync(self.f.fileno())
        return {"tokens": self.tokens, "documents": self.docs, "names": list(self.names)}

    def finish(self) -> dict:
        """Close the file; its manifest entry (the file stays where it is)."""
        self.sync()
        self.f.close()
        if self.tokens == 0:
            raise DataError(f"{self.path.name} would be empty: the source has too little text for this split")
        return {"file": self.path.name, "sha256": self.h.hexdigest(), "tokens": self.tokens,
                "documents": self.docs, "works": self.names if len(self.names) <= _MAX_NAMES else None}

    def close(self) -> None:
        self.f.close()


class _File:
    """One read-only descriptor per process (reopened after a fork), shared by a shard's views."""

    def __init__(self, path: Path):
        self.path, self.fd, self.pid = Path(path), -1, -1

    def fileno(self) -> int:
        if self.pid != os.getpid():
            try:
                self.fd, self.pid = os.open(self.path, os.O_RDONLY), os.getpid()
            except FileNotFoundError:
                raise DataError(f"{self.path} disappeared while in use; rebuild it with "
                                f"{prepare_command(rebuild=True)}") from None
        return self.fd

    def __del__(self):
        if self.pid == os.getpid():
            os.close(self.fd)


class TokenShard:
    """Read-only token ids of one shard (or a contiguous view): ``len``, ``shard[i]``, ``shard[a:b]`` (a lazy
    view), ``np.asarray(shard)`` and :meth:`windows` (batching). Every read checks it got all its bytes."""

    def __init__(self, path: Path, dtype: np.dtype, tokens: int, fix: str = ""):
        self.path, self.dtype, self.fix = Path(path), np.dtype(dtype), fix
        self.file_tokens = tokens            # what the manifest says the whole file holds
        self._file = _File(self.path)
        self._start, self._len = 0, tokens

    def _view(self, start: int, length: int) -> "TokenShard":
        view = copy.copy(self)               # shares the descriptor
        view._start, view._len = self._start + start, length
        return view

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self._len if key < 0 else 0)
            if not 0 <= i < self._len:
                raise IndexError(f"index {int(key)} out of range for {self._len} tokens")
            return self.read(i, 1)[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(self._len)
            view = self._view(start, max(0, stop - start))
            return view if step == 1 else np.asarray(view)[::step]
        raise TypeError(f"TokenShard indices are ints or slices, not {type(key).__name__}; "
                        f"use .windows(starts, length) for many windows")

    def __iter__(self):
        for start in range(0, self._len, 1 << 20):
            yield from self.read(start, min(1 << 20, self._len - start))

    def __array__(self, dtype=None, copy=None):
        a = self.read(0, self._len)
        return a if dtype is None else a.astype(dtype)

    def read(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens from ``start`` (relative to this view)."""
        out = np.empty(count, dtype=self.dtype)
        view, nbytes = memoryview(out).cast("B"), count * self.dtype.itemsize
        offset, done = (self._start + start) * self.dtype.itemsize, 0
        while done < nbytes:
            got = os.preadv(self._file.fileno(), [view[done:done + min(_READ_PIECE, nbytes - done)]], offset + done)
            if got == 0:
                self._short(offset + done, nbytes - done)
            done += got
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``len(starts) x length`` tokens: row i is ``self[starts[i] : starts[i] + length]``."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() + length > self._len):
            raise IndexError(f"windows [{starts.min()}, {starts.max() + length}) outside {self._len} tokens")
        out = np.empty((len(starts), length), dtype=self.dtype)
        for i, s in enumerate(starts.tolist()):
            out[i] = self.read(s, length)
        return out

    def _short(self, offset: int, missing: int) -> None:
        have = os.fstat(self._file.fileno()).st_size
        raise DataError(f"{self.path}: {missing} bytes missing at byte {offset}: the file has {have} bytes, its "
                        f"manifest says {self.file_tokens * self.dtype.itemsize} (truncated or replaced while in "
                        f"use); rebuild it with {self.fix or prepare_command(rebuild=True)}")
