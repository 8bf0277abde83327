"""The read API for training: open a prepared folder (never build one) after checking that it is what its manifest
says; each problem is one ``DataError`` line naming the file and the command that fixes it. A full sha256 runs once
per host, then a stat stamp stands for it (docs/data.md, "Verification stamps"). A shard is a flat file of
little-endian token ids; the reader uses ``os.pread``, not a memory map, so a shard truncated while a run reads it is
a one-line error instead of a SIGBUS.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .batches import eval_batches, get_batch
from .config import (PROJECT_ROOT, DataConfig, DataError, MissingDataError, dataset_dir_name, effective_token_config,
                     prepare_command, token_config)
from ..base.io import OutputError, atomic_write_json, read_json_object, waiting_lock

__all__ = ["Dataset", "open_dataset", "default_data_dir", "load_split", "MANIFEST", "TOKENIZER_FILE", "FORMAT_VERSION",
           "read_manifest", "verify_file", "verified_manifest", "TokenShard", "digest_fd"]

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
_READ_PIECE = 1 << 28      # bytes per pread call for large reads (Linux caps one call below 2 GiB)
_RACY_S = 2.0                        # no stamp for a fresher file: a coarse mtime could hide a write in the same tick



def read_manifest(out_dir: str | os.PathLike, profile: str | None = None) -> dict:
    """The folder's manifest; a clear error if the folder or the manifest is missing or unreadable."""
    out = Path(out_dir)
    path = out / MANIFEST
    if not out.is_dir():
        raise MissingDataError(f"{out}: no prepared dataset (the folder is missing); prepare it with "
                               f"{prepare_command(profile)}")
    if not path.exists():
        raise MissingDataError(f"{path} is missing: the folder was never completely prepared; prepare it with "
                               f"{prepare_command(profile)}")
    fix = f"rebuild the folder with {prepare_command(profile, rebuild=True)}"
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not a valid manifest ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_VERSION:
        found = m.get("format") if isinstance(m, dict) else None
        raise DataError(f"{path} has format {found!r}, this code reads format {FORMAT_VERSION}; {fix}")
    problem = _manifest_problem(m)
    if problem:
        raise DataError(f"{path}: {problem} (a damaged or edited manifest); {fix}")
    return m


# the manifest fields a reader uses -> (type, what is allowed); hand-written: seven fields do not need a schema library
_MANIFEST_FIELDS = {
    "dtype": (str, lambda v: v in ("uint16", "uint32"), "'uint16' or 'uint32'"),
    "vocab_size": (int, lambda v: v >= 1, "an integer >= 1"),
    "tokenizer.sha256": (str, lambda v: len(v) == 64, "a sha256 hex digest"),
    **{f"splits.{split}.{key}": rule for split in ("train", "val") for key, rule in {
        "file": (str, lambda v: v and "/" not in v and v not in (".", ".."), "a file name in the folder"),
        "sha256": (str, lambda v: len(v) == 64, "a sha256 hex digest"),
        "tokens": (int, lambda v: v >= 0, "an integer >= 0")}.items()},
}


def _manifest_problem(m: dict) -> str | None:
    """The first manifest field that is missing, of the wrong type or out of range, said as a user reads it."""
    for field, (kind, ok, allowed) in _MANIFEST_FIELDS.items():
        value: object = m
        for part in field.split("."):
            if not isinstance(value, dict) or part not in value:
                return f"{field} is missing"
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
            return f"{field}={value!r} is invalid: must be {allowed}"
    return None


def _dtype(m: dict) -> np.dtype:
    return np.dtype(m["dtype"]).newbyteorder("<")


def digest_fd(fd: int, dtype: np.dtype | None = None) -> tuple[str, int | None]:
    """sha256 of an open file read from its start (the descriptor stays open) and, for a shard of ``dtype``, its
    largest token id, in the same pass."""
    h, top = hashlib.sha256(), None
    with open(fd, "rb", closefd=False) as f:
        while chunk := f.read(1 << 24):                 # 16 MiB: a multiple of every token size
            h.update(chunk)
            if dtype is not None and len(chunk) >= dtype.itemsize:
                ids = np.frombuffer(chunk, dtype, len(chunk) // dtype.itemsize)
                top = max(top if top is not None else -1, int(ids.max()))
    return h.hexdigest(), top


def _stat_key(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class _Stamps:
    """The host's stamp file for one folder (file name -> sha256 + stat key): in the folder, or under
    ``~/.cache/mapl/verified`` when the folder cannot be written (a read-only data mount)."""

    def __init__(self, folder: Path):
        host = socket.gethostname() or "host"
        fallback = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mapl" / "verified"
                    / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]}-{host}.json")
        self.candidates = [folder / f".verified-{host}.json", fallback]
        self.path: Path | None = None        # where this process records, once it holds that place's lock

    def matches(self, name: str, key: tuple, sha: str, vocab: int | None) -> bool:
        """A stamp of this content whose token ids were checked against ``vocab`` (None: not a shard)."""
        for path in self.candidates:
            entry = (read_json_object(path) or {}).get(name)
            if entry and entry.get("sha256") == sha and tuple(entry.get("stat", ())) == key and (
                    vocab is None or isinstance(entry.get("max_id"), int) and entry["max_id"] < vocab):
                return True
        return False

    @contextlib.contextmanager
    def locked(self, what: str) -> Iterator[None]:
        """Hold the lock of the first place that can be written (none: hash without a stamp)."""
        with contextlib.ExitStack() as stack:
            for path in self.candidates:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    stack.enter_context(waiting_lock(path, what))
                except (OSError, OutputError):
                    continue
                self.path = path
                break
            yield

    def record(self, name: str, key: tuple, sha: str, max_id: int | None) -> None:
        if self.path is None:
            return
        stamps = read_json_object(self.path) or {}
        stamps[name] = {"sha256": sha, "stat": list(key), **({} if max_id is None else {"max_id": max_id})}
        with contextlib.suppress(OSError, OutputError):     # no stamp: the next start hashes again (slower, still safe)
            atomic_write_json(self.path, stamps)


def verify_file(path: Path, sha256: str, nbytes: int | None, profile: str | None = None, full: bool = False,
                shard: tuple[np.dtype, int] | None = None) -> None:
    """``path`` holds ``nbytes`` bytes whose sha256 is ``sha256`` and, for a ``shard`` (dtype, vocabulary size), only
    token ids below the vocabulary size; or a ``DataError`` says what is wrong."""
    dtype, vocab = shard if shard else (None, None)
    fix = prepare_command(profile, rebuild=True)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise MissingDataError(f"{path} is missing (manifest.json lists it with sha256 {sha256}); rebuild the "
                               f"folder with {fix}") from None
    if nbytes is not None and st.st_size != nbytes:
        raise DataError(f"{path} has {st.st_size} bytes, manifest.json says {nbytes} (truncated or replaced); "
                        f"rebuild it with {fix}")
    stamps = _Stamps(path.parent)
    if not full and stamps.matches(path.name, _stat_key(st), sha256, vocab):
        return
    with stamps.locked(f"hashing {path}"):
        if not full and stamps.matches(path.name, _stat_key(path.stat()), sha256, vocab):
            return                   # another process of this host hashed it while we waited
        with open(path, "rb") as f:
            before = _stat_key(os.fstat(f.fileno()))
            actual, max_id = digest_fd(f.fileno(), dtype)
            after = os.fstat(f.fileno())
        if actual != sha256:
            raise DataError(f"{path}: sha256 mismatch: manifest.json expects {sha256}, the file has {actual} "
                            f"(corrupt, or from another preparation); rebuild it with {fix}")
        if vocab is not None and max_id is not None and max_id >= vocab:     # else torch.embedding's IndexError
            raise DataError(f"{path}: token id {max_id} is beyond the vocabulary (manifest.json: vocab_size {vocab}): "
                            f"the shard and the tokenizer come from different preparations; rebuild it with {fix}")
        # a stamp only if the file stayed unchanged while hashed and is not too fresh to trust
        if _stat_key(after) == before and time.time() - max(after.st_mtime, after.st_ctime) > _RACY_S:
            stamps.record(path.name, before, sha256, max_id)


def verified_manifest(out: Path, cfg: DataConfig | None = None, profile: str | None = None,
                      full: bool = False) -> dict:
    """The manifest of a complete folder whose shards and tokenizer match it (and ``cfg``, if given)."""
    m = read_manifest(out, profile)
    if cfg is not None:             # refuse a folder prepared for other data settings
        want, have = effective_token_config(token_config(cfg)), effective_token_config(m.get("config", {}))
        diffs = [f"{k}: folder {have.get(k)!r}, config {want.get(k)!r}" for k in token_config(cfg)
                 if (k in want or k in have) and have.get(k) != want.get(k)]
        if diffs:
            raise DataError(f"{out} holds data prepared for other settings ({'; '.join(diffs)}); use another folder "
                            f"or replace it with {prepare_command(profile, rebuild=True)}")
    dtype = _dtype(m)
    for split in ("val", "train"):
        entry = m["splits"][split]
        verify_file(out / entry["file"], entry["sha256"], entry["tokens"] * dtype.itemsize, profile, full,
                    shard=(dtype, m["vocab_size"]))
    verify_file(out / TOKENIZER_FILE, m["tokenizer"]["sha256"], None, profile, full)
    return m


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
            view = copy.copy(self)           # a lazy view that shares the descriptor
            view._start, view._len = self._start + start, max(0, stop - start)
            return view if step == 1 else np.asarray(view)[::step]
        raise TypeError(f"TokenShard indices are ints or slices, not {type(key).__name__}; "
                        f"use .windows(starts, length) for many windows")

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


def default_data_dir(cfg: DataConfig) -> Path:
    """``<project>/data/<dataset_dir_name(cfg)>``."""
    return PROJECT_ROOT / "data" / dataset_dir_name(cfg)


@dataclass(frozen=True)
class Dataset:
    """A prepared, verified folder: its manifest and the two shards, plus the batch policy."""
    path: Path
    manifest: dict
    train: TokenShard
    val: TokenShard
    sampling: str = "uniform"

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int):
        """The training batch ``(x, y)`` of ``step`` (see :mod:`mapl.data.batches`)."""
        return get_batch(self.train, batch_size, seq_len, seed, step, self.sampling)

    def eval_batches(self, batch_size: int, seq_len: int, max_tokens: int, offset: int = 0, select_every: int = 0,
                     part: str = "report") -> list:
        """Fixed validation batches from token ``offset`` of the val shard (:func:`mapl.data.batches.eval_batches`)."""
        return eval_batches(self.val[offset:], batch_size, seq_len, max_tokens, select_every, part)


def _shard(out: Path, m: dict, split: str, profile: str | None) -> TokenShard:
    entry = m["splits"][split]
    return TokenShard(out / entry["file"], _dtype(m), entry["tokens"],
                      fix=prepare_command(profile, rebuild=True))


def open_dataset(cfg: DataConfig, data_dir: str | os.PathLike | None = None, *, profile: str | None = None,
                 full_verify: bool = False) -> Dataset:
    """The prepared data of ``cfg`` in ``data_dir`` (default ``data/<dataset_dir_name>``), verified; a missing,
    truncated, corrupt or other settings' folder is a ``DataError`` (``profile`` makes its suggested command exact)."""
    out = Path(data_dir) if data_dir else default_data_dir(cfg)
    m = verified_manifest(out, cfg, profile, full=full_verify)
    return Dataset(out, m, _shard(out, m, "train", profile), _shard(out, m, "val", profile), cfg.sampling)


def load_split(out_dir: str | os.PathLike, split: str) -> TokenShard:
    """``train`` or ``val`` of a prepared folder, after checking it against the manifest (no config check)."""
    out = Path(out_dir)
    m = read_manifest(out)
    entry = m["splits"][split]
    verify_file(out / entry["file"], entry["sha256"], entry["tokens"] * _dtype(m).itemsize,
                shard=(_dtype(m), m["vocab_size"]))
    return _shard(out, m, split, None)
