"""Safe outputs: atomic writes (unique temp file, fsync, rename), writable checks before any work (``check_writable``)
and exclusive output locks (``OutputLock``); an output problem (full disk, read-only folder, ...) is one
``OutputError`` line naming the path and the cause.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shlex
import stat
import sys
import time
from pathlib import Path

__all__ = ["OutputError", "read_json_object", "atomic_write_text", "atomic_write_bytes", "atomic_write_json", "atomic_torch_save",
           "check_writable", "refuse_non_regular", "OutputLock", "waiting_lock", "os_error_hint",
           "owned_temp_folder"]

PathLike = str | os.PathLike
log = logging.getLogger(__name__)


class OutputError(ValueError):
    """An output path cannot be written (or is in use); the message names the path and the cause."""


# errno -> what the user can do about it (the OS's own words come first in the message)
_HINTS = {
    errno.ENOSPC: "the disk is full: free space or choose another folder",
    errno.EDQUOT: "the disk quota is exhausted: free space or choose another folder",
    errno.EFBIG: "the file-size limit is reached (ulimit -f) or the disk is full",
    errno.EACCES: "no permission to write there: choose a writable folder",
    errno.EPERM: "no permission to write there: choose a writable folder",
    errno.EROFS: "the filesystem is read-only: choose a writable folder",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOTDIR: "a parent of it is a file, not a folder",
    errno.EEXIST: "a file is where its folder should be",
    errno.ENAMETOOLONG: "the file name is too long",
}


# a path in this checkout that cannot be written means a read-only checkout: the way on is a writable copy
_CHECKOUT = Path(__file__).resolve().parents[2]
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
CHECKOUT_HINT = ("this checkout is not writable: run in a writable copy, e.g. `mapl workspace repro --profile P --dir "
                 "../mapl-P`, or give output paths outside it")


def os_error_hint(path: PathLike, err: int | None) -> str | None:
    """What the user can do about OS error ``err`` on ``path``: a full disk, a read-only folder, this checkout."""
    if err in _NOT_WRITABLE and Path(os.path.abspath(path)).is_relative_to(_CHECKOUT):
        return CHECKOUT_HINT
    return _HINTS.get(err)


def _output_error(path: Path, e: OSError, doing: str = "cannot write") -> OutputError:
    cause = e.strerror or str(e)
    hint = os_error_hint(path, e.errno)
    return OutputError(f"{doing} {path}: {cause}" + (f" ({hint})" if hint else ""))


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def refuse_non_regular(path: PathLike) -> None:
    """An output is a regular file or does not exist yet: the rename of an atomic write would otherwise replace a
    device node, FIFO, socket or folder (``--out /dev/null`` as root would replace the system's /dev/null). A symbolic
    link is followed only to a regular file; the link itself is then replaced by the file, never its target."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return       # a new file, a dangling link the rename replaces, or a bad parent the next step names
    for test, kind in _KINDS:
        if test(mode):
            via = f" (a symbolic link to {os.path.realpath(path)})" if path.is_symlink() else ""
            raise OutputError(f"cannot write {path}: it is {kind}{via}, not a regular file; give a file path "
                              "(an output replaces only regular files)")


def _open_temp(path: Path) -> tuple[int, Path]:
    """Create a fresh temp file next to ``path`` (O_EXCL: never shared, mode from the umask)."""
    refuse_non_regular(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(path, e, "cannot create the folder of") from e
    # PID + random token: unique per process and per call; '.tmp' so no results glob picks it up
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
    except OSError as e:
        raise _output_error(path, e) from e


@contextlib.contextmanager
def _atomic_file(path: PathLike):
    """Yield a binary file object; on success fsync + rename over ``path``, on any failure remove it (an ``OSError``
    becomes one ``OutputError``; anything else propagates unchanged)."""
    path = Path(path)
    fd, tmp = _open_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise _output_error(path, e) from e
        raise
    with contextlib.suppress(OSError):      # make the rename itself durable (best effort: some filesystems refuse)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json_object(path: PathLike) -> dict | None:
    """The JSON object in ``path``; None when the file is missing, unreadable, not JSON or not an object."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename); ``OutputError`` on failure."""
    with _atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically; ``OutputError`` on failure."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (a non-serialisable object fails before any file)."""
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


class _RecordingWriter:
    """Remembers the OSError behind a failed write: torch.save reports it only as a zip-writer ``RuntimeError``."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, b):
        return self._recording(self.f.write, b)

    def flush(self):
        return self._recording(self.f.flush)

    def _recording(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            self.error = e
            raise


def atomic_torch_save(obj, path: PathLike) -> None:
    """``torch.save(obj, path)`` atomically; a write failure is one ``OutputError`` naming the cause."""
    import torch                        # lazy: the JSON/text writers must not pay for importing torch

    with _atomic_file(path) as f:
        writer = _RecordingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError as e:
            if writer.error is None:     # not an I/O failure: a real error, keep it as it is
                raise
            raise writer.error from e    # _atomic_file turns it into OutputError and removes the temp


def check_writable(path: PathLike) -> Path:
    """Fail now, before any work, if ``path`` could not be written at the end of the run: creates its folder and a
    probe file named like the real temp file (so a name that is too long fails here too)."""
    path = Path(path)
    fd, tmp = _open_temp(path)
    os.close(fd)
    try:
        tmp.unlink()
    except OSError as e:
        raise _output_error(path, e, "cannot remove a probe file next to") from e
    return path


class OutputLock:
    """An exclusive lock on a run's output paths (``None`` skipped) for the whole run: a ``<path>.lock`` sidecar
    holding ``fcntl.flock`` and the holder's PID and command, released by the OS even on SIGKILL. A path locked by
    another run, or one file given twice, is an ``OutputError``. (Hand-written rather than a lock package: the
    refusal names the holding run, and no such package is a dependency.)"""

    def __init__(self, *paths: PathLike | None, **named: PathLike | None):
        items = [(str(p), p) for p in paths] + list(named.items())
        self._paths = [(label, Path(p)) for label, p in items if p is not None]
        self._held: list[tuple[Path, int]] = []
        seen: dict[Path, str] = {}
        for label, p in self._paths:
            key = p.resolve()
            if key in seen:
                which = f"{label} is given twice" if seen[key] == label else f"{seen[key]} and {label} are the same file"
                raise OutputError(f"{which} ({key}): every output of a run needs its own path, "
                                  f"e.g. --out r.json --ckpt r.pt")
            seen[key] = label

    def __enter__(self) -> OutputLock:
        try:
            for _, p in self._paths:
                self._held.append((p, _acquire(p)))
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for p, fd in reversed(self._held):
            _release(p, fd)
        self._held.clear()


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _release(path: Path, fd: int) -> None:
    """Remove the sidecar (while still locked, so no waiter locks a file being deleted), then unlock."""
    with contextlib.suppress(OSError):
        _lock_path(path).unlink()
    os.close(fd)


@contextlib.contextmanager
def waiting_lock(path: PathLike, what: str):
    """The lock on ``<path>.lock`` for a job a second process waits for rather than is refused by (preparing a
    dataset, stamping its hashes); the waiter logs who holds it."""
    fd = _acquire(Path(path), waiting_for=what)
    try:
        yield
    finally:
        _release(Path(path), fd)


def _acquire(path: Path, waiting_for: str | None = None) -> int:
    """Lock ``<path>.lock``, write our PID and command into it and return its descriptor. Held by another process:
    an ``OutputError``, or with ``waiting_for`` (the job both take the lock for) a log line and a wait."""
    lock = _lock_path(path)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(path, e, "cannot create the folder of") from e
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise _output_error(lock, e, "cannot create the lock file") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting_for is None:
                os.close(fd)
                holder = _read_holder(lock)
                raise OutputError(f"{path} is in use by {holder}: wait for that run to finish, stop it, "
                                  f"or choose another output path") from None
            log.info("waiting for %s, which is %s", _read_holder(lock), waiting_for)
            fcntl.flock(fd, fcntl.LOCK_EX)
        # the holder we waited on may have unlinked the sidecar between our open and our flock:
        # then we hold a lock on a deleted file and must start over on the new one
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{shlex.join(sys.orig_argv or [sys.executable, *sys.argv])}\n".encode())
    except OSError as e:                 # a full disk: leave no 0-byte lock file behind
        _release(path, fd)
        raise _output_error(lock, e, "cannot write the lock file") from e
    return fd


def _read_holder(lock: Path) -> str:
    """'PID 1234 (mapl train ...)' from a held sidecar (the holder writes it just after locking)."""
    for _ in range(20):
        with contextlib.suppress(OSError):
            pid, _, cmd = lock.read_text().partition("\n")
            if pid.strip().isdigit():
                return f"PID {pid.strip()} ({cmd.strip()})"
        time.sleep(0.01)
    return f"another process (see {lock})"


def owned_temp_folder(prefix: str) -> str:
    """A fresh temporary folder ``<prefix>-<pid>-<random>`` for this process. The folders of ``prefix`` whose process
    is gone (killed before it could remove its own, e.g. by SIGKILL) are removed first."""
    import shutil
    import tempfile
    for old in Path(tempfile.gettempdir()).glob(f"{prefix}-*-*"):
        pid = old.name[len(prefix) + 1:].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's process: alive, and not ours to clean
        return True
    return True
