"""Safe outputs (mapl/base/io.py): unique temp files under concurrency, cleanup on failure, one-line
write errors (disk full, read-only folder), writable checks before work, exclusive output locks."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from mapl.base.io import (OutputError, OutputLock, atomic_torch_save, atomic_write_json, atomic_write_text,
                     check_writable)

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *args, **kw) -> subprocess.Popen:
    """Start ``python -c code args...`` with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MAPL_DEBUG="0")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock")))


# ---- atomic writes --------------------------------------------------------------------------
WRITER = """
import sys
from mapl.base.io import atomic_torch_save, atomic_write_json
path, tag, n, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if kind == "torch":
    import torch
    payload = {"tag": torch.full((50_000,), float(tag))}
    for _ in range(n):
        atomic_torch_save(payload, path)
else:
    payload = {"tag": tag, "data": [tag] * 20_000}
    for _ in range(n):
        atomic_write_json(path, payload)
"""


@pytest.mark.process
@pytest.mark.parametrize("kind,n", [("json", 150), ("torch", 40)])
def test_two_processes_writing_one_path_never_collide(tmp_path, kind, n):
    # the old fixed name 'r.pt.tmp' made one writer die with [Errno 2] 'r.pt.tmp' -> 'r.pt'
    path = tmp_path / "r.out"
    procs = [_python(WRITER, path, tag, n, kind) for tag in (1, 2)]
    reads = 0
    while any(p.poll() is None for p in procs):
        if kind == "json" and path.exists():        # a reader never sees a torn file
            assert json.loads(path.read_text())["tag"] in (1, 2)
            reads += 1
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0 and err == "", err
    if kind == "json":
        final = json.loads(path.read_text())
        assert final["data"] == [final["tag"]] * 20_000
    else:
        t = torch.load(path, weights_only=True)["tag"]
        assert t.shape == (50_000,) and float(t[0]) in (1.0, 2.0) and bool((t == t[0]).all())
    assert _leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    atomic_write_json(path, {"old": True})

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OutputError, match=rf"cannot write {path}: No space left on device \(the disk is full"):
        atomic_write_json(path, {"new": True})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": True}
    assert _leftovers(tmp_path) == []


class _InterruptWhilePickled:
    def __reduce__(self):
        raise KeyboardInterrupt


def test_an_error_while_saving_propagates_and_removes_the_temp(tmp_path):
    path = tmp_path / "c.pt"
    atomic_torch_save({"w": torch.ones(3)}, path)
    with pytest.raises(KeyboardInterrupt):       # Ctrl-C in the middle of torch.save
        atomic_torch_save({"w": torch.zeros(3), "x": _InterruptWhilePickled()}, path)
    with pytest.raises(Exception) as e:           # an unpicklable object is a bug, not an output error
        atomic_torch_save({"f": lambda: 0}, path)
    assert not isinstance(e.value, OutputError)
    with pytest.raises(TypeError):                # not JSON: refused before any file is created
        atomic_write_json(tmp_path / "r.json", {"x": object()})
    assert torch.load(path, weights_only=True)["w"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_text_json_and_torch_round_trip(tmp_path):
    atomic_write_text(tmp_path / "a" / "b.txt", "héllo\n")            # creates the folder
    atomic_write_json(tmp_path / "r.json", {"loss": 1.5})
    atomic_torch_save({"w": torch.arange(4)}, tmp_path / "c.pt")
    assert (tmp_path / "a" / "b.txt").read_text(encoding="utf-8") == "héllo\n"
    assert json.loads((tmp_path / "r.json").read_text()) == {"loss": 1.5}
    assert torch.load(tmp_path / "c.pt", weights_only=True)["w"].tolist() == [0, 1, 2, 3]
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~_umask()   # not mkstemp's 0600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


DISK_FULL = """
import resource, sys
from mapl.base.cli import run_cli
from mapl.base.io import atomic_torch_save, atomic_write_json
path, kind = sys.argv[1], sys.argv[2]
if kind == "torch":
    import torch
    obj = {"w": torch.zeros(1_000_000)}
    save = lambda: atomic_torch_save(obj, path)
else:
    obj = {"w": [0.5] * 1_000_000}
    save = lambda: atomic_write_json(path, obj)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))   # like `ulimit -f 64`
sys.exit(run_cli(lambda argv: save(), [], prog="disk-full"))
"""


@pytest.mark.process
@pytest.mark.parametrize("kind", ["json", "torch"])
def test_disk_full_is_one_line_and_keeps_the_old_file(tmp_path, kind):
    path = tmp_path / "out.bin"
    path.write_text("previous results\n")
    p = _python(DISK_FULL, path, kind)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: cannot write {path}: File too large") and "ulimit -f" in lines[0], lines[0]
    assert path.read_text() == "previous results\n"
    assert _leftovers(tmp_path) == []


READ_ONLY = """
import os, sys
from mapl.base.cli import run_cli
from mapl.base.io import atomic_write_json, check_writable
if os.geteuid() == 0:       # root ignores folder permissions: act as nobody from here on
    os.seteuid(65534)
path, what = sys.argv[1], sys.argv[2]
act = (lambda argv: check_writable(path)) if what == "check" else (lambda argv: atomic_write_json(path, {"a": 1}))
sys.exit(run_cli(act, [], prog="read-only"))
"""


@pytest.mark.process
@pytest.mark.parametrize("what", ["check", "write"])
def test_read_only_folder_is_one_line(what):
    # a folder every user can traverse (pytest's tmp_path is private to root)
    base = Path(tempfile.mkdtemp(prefix="mapl-ro-"))
    try:
        base.chmod(0o755)
        ro = base / "ro"
        ro.mkdir(mode=0o555)
        ro.chmod(0o555)
        p = _python(READ_ONLY, ro / "r.json", what, cwd=base)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0] == (f"error: cannot write {ro / 'r.json'}: Permission denied "
                            f"(no permission to write there: choose a writable folder)"), lines[0]
        assert list(ro.iterdir()) == []
    finally:
        (base / "ro").chmod(0o755)
        shutil.rmtree(base)


# ---- writable checks ------------------------------------------------------------------------
def test_check_writable_creates_the_folder_and_leaves_nothing(tmp_path):
    path = tmp_path / "reports" / "micro" / "r.json"
    assert check_writable(path) == path
    assert path.parent.is_dir() and list(path.parent.iterdir()) == []


@pytest.mark.parametrize("case,message", [
    ("dir", "is a directory"),
    ("under_file", "a file is where its folder should be"),
    ("under_file_deeper", "a parent of it is a file, not a folder"),
    ("long_name", "File name too long"),
])
def test_check_writable_refuses_an_impossible_path(tmp_path, case, message):
    (tmp_path / "file").write_text("x")
    path = {"dir": tmp_path, "under_file": tmp_path / "file" / "r.json",
            "under_file_deeper": tmp_path / "file" / "sub" / "r.json",
            "long_name": tmp_path / ("r" * 250 + ".json")}[case]
    with pytest.raises(OutputError, match=message) as e:
        check_writable(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def _not_regular(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "link_to_fifo":
        os.mkfifo(tmp_path / "target")
        path.symlink_to(tmp_path / "target")
    return path


@pytest.mark.parametrize("kind,message", [("fifo", "a FIFO"), ("socket", "a socket"),
                                          ("link_to_fifo", "a FIFO .*a symbolic link to")])
@pytest.mark.parametrize("write", ["json", "torch", "check"])
def test_an_output_that_is_not_a_regular_file_is_never_replaced(tmp_path, kind, message, write):
    # the rename of an atomic write replaced whatever stood at the path: a device node, a FIFO, a socket
    path = _not_regular(tmp_path, kind)
    before = os.lstat(path)
    call = {"json": lambda: atomic_write_json(path, {"a": 1}), "torch": lambda: atomic_torch_save({"a": 1}, path),
            "check": lambda: check_writable(path)}[write]
    with pytest.raises(OutputError, match=message) as e:
        call()
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert str(path) in str(e.value) and "\n" not in str(e.value) and _leftovers(tmp_path) == []


def test_a_device_node_is_refused_without_writing(monkeypatch):
    # read-only on /dev/null: the refusal comes from its stat, before any temp file or rename
    monkeypatch.setattr(os, "open", lambda *a, **k: pytest.fail("a device node reached os.open"))
    with pytest.raises(OutputError, match="/dev/null: it is a character device, not a regular file"):
        atomic_write_json("/dev/null", {"a": 1})


def test_a_symbolic_link_to_a_regular_file_is_replaced_and_its_target_kept(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    link = tmp_path / "r.json"
    link.symlink_to(target)
    atomic_write_json(link, {"a": 1})
    assert not link.is_symlink() and json.loads(link.read_text()) == {"a": 1} and target.read_text() == "{}"


def test_a_lock_whose_holder_line_cannot_be_written_leaves_no_lock_file(tmp_path, monkeypatch):
    real_write = os.write

    def full_disk(fd, data):
        if data.startswith(str(os.getpid()).encode()):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OutputError, match=r"cannot write the lock file .*r.json.lock: No space left on device \(the disk"):
        with OutputLock(tmp_path / "r.json"):
            pass
    assert list(tmp_path.iterdir()) == []


# ---- output locks ---------------------------------------------------------------------------
HOLDER = """
import sys, time
from mapl.base.io import OutputLock
with OutputLock(results=sys.argv[1], checkpoint=sys.argv[2]):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.mark.process
def test_a_second_run_is_refused_with_the_holder_and_may_go_on_once_it_died(tmp_path):
    out, ckpt = tmp_path / "r.json", tmp_path / "r.pt"
    holder = _python(HOLDER, out, ckpt, "--marker-of-the-holder")
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        for path in (out, ckpt):
            with pytest.raises(OutputError) as e:
                with OutputLock(results=tmp_path / "other.json", checkpoint=path):
                    pass
            msg = str(e.value)
            assert msg.startswith(f"{path} is in use by PID {holder.pid} (") and "--marker-of-the-holder" in msg, msg
        assert not (tmp_path / "other.json.lock").exists()          # a refused run releases what it took
    finally:
        holder.send_signal(signal.SIGKILL)                           # no cleanup runs: the OS drops the flock
        holder.wait()
    assert (tmp_path / "r.pt.lock").exists()                         # stale sidecar, but no longer locked
    with OutputLock(results=out, checkpoint=ckpt):
        assert (tmp_path / "r.pt.lock").read_text().split("\n")[0] == str(os.getpid())
    assert _leftovers(tmp_path) == []                                # removed on a clean exit


def test_a_waiter_that_opened_a_sidecar_being_removed_does_not_also_win(tmp_path, monkeypatch):
    # A releases (unlinks its sidecar) between B's open and B's flock, and C locks a new sidecar at
    # once: B's flock then succeeds on the deleted file and B must notice, or B and C both hold it
    import fcntl
    real_flock, path = fcntl.flock, tmp_path / "r.json"
    a, c = OutputLock(path).__enter__(), OutputLock(path)

    def flock_after_a_handover(fd, op):
        if not c._held:
            monkeypatch.setattr(fcntl, "flock", real_flock)
            a.release()
            c.__enter__()
        return real_flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock_after_a_handover)
    with pytest.raises(OutputError, match=f"in use by PID {os.getpid()}"):
        OutputLock(path).__enter__()
    c.release()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("paths,message", [
    ({"results": "x.pt", "checkpoint": "x.pt"}, "results and checkpoint are the same file"),
    ({"results": "x.pt", "checkpoint": "sub/../x.pt"}, "results and checkpoint are the same file"),
    ({"results": "link.pt", "checkpoint": "x.pt"}, "results and checkpoint are the same file"),
    (("x.pt", "x.pt"), "x.pt is given twice"),
])
def test_one_run_cannot_name_the_same_file_twice(tmp_path, monkeypatch, paths, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.pt").symlink_to(tmp_path / "x.pt")
    with pytest.raises(OutputError, match=message) as e:
        OutputLock(**paths) if isinstance(paths, dict) else OutputLock(*paths)
    assert str(tmp_path / "x.pt") in str(e.value)
    assert _leftovers(tmp_path) == []


def test_lock_skips_missing_paths_and_refuses_a_nested_second_lock(tmp_path):
    with OutputLock(results=tmp_path / "r.json", checkpoint=None) as lock:
        assert _leftovers(tmp_path) == ["r.json.lock"]
        with pytest.raises(OutputError, match=f"in use by PID {os.getpid()}"):
            with OutputLock(tmp_path / "r.json"):
                pass
        lock.release()
        assert _leftovers(tmp_path) == []
        with OutputLock(tmp_path / "r.json"):                       # free again after release
            pass


def test_waiting_lock_waits_for_the_holder_and_says_who_it_is(tmp_path, caplog):
    """The data preparation's lock (mapl.base.io.waiting_lock): a second taker waits, logging the holder,
    and gets the lock once the first releases it; the sidecar is gone afterwards."""
    import logging
    import threading
    from mapl.base.io import waiting_lock
    target = tmp_path / ".prepare"
    order, second_in = [], threading.Event()

    def second():
        with waiting_lock(target, "preparing data/x"):
            order.append("second")
            second_in.set()
    with caplog.at_level(logging.INFO, logger="mapl.base.io"):
        with waiting_lock(target, "preparing data/x"):
            t = threading.Thread(target=second)
            t.start()
            assert not second_in.wait(0.3)                 # it waits while the first holds the lock
            order.append("first")
        t.join(5)
    assert order == ["first", "second"]
    assert any("waiting for PID" in r.message and "preparing data/x" in r.message for r in caplog.records)
    assert not (tmp_path / ".prepare.lock").exists()
