"""The CLI error policy (mapl/base/cli.py): each way a run can end gives its documented exit code, a user
error is exactly one line on stderr, a bug keeps its traceback, --debug / MAPL_DEBUG=1 show it."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mapl.base.cli import (EXIT_BUG, EXIT_CODES, EXIT_INTERRUPTED, EXIT_NON_FINITE, EXIT_NOT_CONSISTENT,
                           EXIT_PEER_FAILED, EXIT_STEP_FAILED, EXIT_USER_ERROR, PeerFailure, error_line, exit_code, run_cli)

ROOT = Path(__file__).resolve().parents[1]

ENTRY = """
import argparse, os, signal, sys, time
from mapl.base.cli import PeerFailure, add_debug_flag, run_cli
from mapl.base.io import OutputError

def main(argv):
    ap = add_debug_flag(argparse.ArgumentParser(prog="tiny"))
    ap.add_argument("kind")
    kind = ap.parse_args(argv).kind
    assert "--debug" not in argv, "run_cli passes main its arguments without --debug"
    if kind == "ok":
        print("done")
    elif kind == "code":
        return 5
    elif kind == "output":
        raise OutputError("cannot write /x/r.json: Permission denied")
    elif kind == "multiline":
        raise ValueError("train.steps='abc' is invalid:\\n  must be an integer")
    elif kind == "missing":
        open("no-such-input.txt")
    elif kind == "nan":
        raise FloatingPointError("non-finite training loss nan at step 3")
    elif kind == "peer":
        raise PeerFailure("recv from stage 1 failed at step 3: peer died")
    elif kind == "stop":
        raise KeyboardInterrupt("stopped by signal at step 3; checkpoint c.pt written")
    elif kind == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    elif kind == "bug":
        return 1 // 0

sys.exit(run_cli(main, prog="python -m tiny"))
"""

CASES = [
    # (arguments, environment, exit code, the one stderr line (None: no stderr), traceback printed)
    (["ok"], {}, 0, None, False),
    (["code"], {}, 5, None, False),
    (["output"], {}, EXIT_USER_ERROR, "error: cannot write /x/r.json: Permission denied", False),
    (["multiline"], {}, EXIT_USER_ERROR, "error: train.steps='abc' is invalid: must be an integer", False),
    (["missing"], {}, EXIT_USER_ERROR, "error: no-such-input.txt: No such file or directory", False),
    (["nan"], {}, EXIT_NON_FINITE, "error: non-finite training loss nan at step 3", False),
    (["peer"], {}, EXIT_PEER_FAILED, "error: recv from stage 1 failed at step 3: peer died", False),
    (["stop"], {}, EXIT_INTERRUPTED, "interrupted: stopped by signal at step 3; checkpoint c.pt written", False),
    (["sigint"], {}, EXIT_INTERRUPTED, "interrupted", False),
    (["sigterm"], {}, EXIT_INTERRUPTED, "interrupted: signal SIGTERM", False),
    # below mapl workspace, which reports the stop of its copy once: the children stop without a line of their own
    (["sigterm"], {"MAPL_SUPERVISED": "1"}, EXIT_INTERRUPTED, None, False),
    (["output"], {"MAPL_SUPERVISED": "1"}, EXIT_USER_ERROR, "error: cannot write /x/r.json: Permission denied", False),
    (["bug"], {}, EXIT_BUG, "python -m tiny: unexpected ZeroDivisionError: this is a bug, please report it with "
                            "the traceback above", True),
    (["output", "--debug"], {}, EXIT_USER_ERROR, "error: cannot write /x/r.json: Permission denied", True),
    (["nan"], {"MAPL_DEBUG": "1"}, EXIT_NON_FINITE, "error: non-finite training loss nan at step 3", True),
]


@pytest.mark.process
@pytest.mark.parametrize("args,env,code,line,traceback", CASES, ids=[" ".join(c[0]) + str(c[1]) for c in CASES])
def test_entry_point_exit_code_and_stderr(tmp_path, args, env, code, line, traceback):
    # SIGINT back to its default in the child: a test run started in the background by a shell
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(ENTRY), *args], cwd=tmp_path, text=True,
                       capture_output=True, timeout=600, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                       env={**os.environ, "PYTHONPATH": str(ROOT), "MAPL_DEBUG": "0", **env})
    assert p.returncode == code, p.stderr
    if line is None:
        assert p.stderr == ""
        return
    lines = p.stderr.strip().splitlines()
    assert lines[-1] == line, p.stderr
    if traceback:
        assert lines[0] == "Traceback (most recent call last):", p.stderr
    else:
        assert len(lines) == 1, p.stderr


POOL_ENTRY = """
import multiprocessing as mp, os, sys, time
from mapl.base.cli import run_cli

def work(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

def main(argv):
    with mp.get_context("spawn").Pool(1) as pool:      # as a sweep runs its group
        pool.map(work, [argv[0]])

if __name__ == "__main__":
    sys.exit(run_cli(main, prog="python -m tiny"))
"""


KILLED_POOL_ENTRY = """
import multiprocessing as mp, os, sys, time
from mapl.orchestration.sweep import worker_init

def work(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    with mp.get_context("spawn").Pool(1, initializer=worker_init, maxtasksperchild=1) as pool:   # as a sweep's
        pool.map(work, [sys.argv[1]])
"""


@contextlib.contextmanager
def _pool_parent(tmp_path, entry: str):
    """``entry`` run as a script (a parent whose spawn pool runs one worker): (the parent, its worker's psutil
    Process once the worker has started); the parent is killed on the way out."""
    import psutil
    (tmp_path / "entry.py").write_text(textwrap.dedent(entry))
    pid_file = tmp_path / "worker.pid"
    p = subprocess.Popen([sys.executable, "entry.py", str(pid_file)], cwd=tmp_path, text=True, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MAPL_DEBUG": "0"})
    try:
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        yield p, psutil.Process(int(pid_file.read_text()))
    finally:
        p.kill()


@pytest.mark.process
def test_a_sweep_killed_outright_takes_its_pool_workers_with_it(tmp_path):
    """SIGKILL to a sweep's process (or to the notebook kernel running it, as papermill's shutdown does): its workers
    get SIGTERM from the kernel (parent-death signal) and stop; was: they trained on, orphaned."""
    with _pool_parent(tmp_path, KILLED_POOL_ENTRY) as (p, worker):
        p.kill()
        p.wait(timeout=60)
        worker.wait(timeout=30)                          # psutil.TimeoutExpired if it lives on


DEATH_SIGNAL_ENTRY = """
import ctypes, multiprocessing as mp, sys, threading
from mapl.orchestration.sweep import worker_init

def work(_):
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)          # PR_GET_PDEATHSIG
    return sig.value, [t.name for t in threading.enumerate()]

if __name__ == "__main__":
    with mp.get_context("spawn").Pool(1, initializer=worker_init, maxtasksperchild=1) as pool:   # as a sweep's
        print(pool.map(work, [0, 1], chunksize=1))
"""


@pytest.mark.process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_pool_workers_carry_no_thread_bound_death_signal(tmp_path):
    """The second run's worker is spawned by the pool's worker-handler thread, which ends at every pool shutdown:
    a parent-death signal would SIGTERM it then (was: a worker killed holding the result queue's lock hung the
    sweep at exit). Every worker watches its parent's pid instead."""
    (tmp_path / "entry.py").write_text(DEATH_SIGNAL_ENTRY)
    out = subprocess.run([sys.executable, "entry.py"], cwd=tmp_path, text=True, capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MAPL_DEBUG": "0"})
    assert out.returncode == 0, out.stderr
    workers = eval(out.stdout)                                  # noqa: S307 -- our own script's repr of a list
    assert [sig for sig, _ in workers] == [0, 0]
    assert all("mapl-parent-watchdog" in names for _, names in workers)


def test_the_parent_death_mechanism_is_one_of_two():
    from mapl.core.runtime.faults import exit_with_parent
    with pytest.raises(ValueError, match=r"mechanism='poll' is invalid: allowed 'prctl', 'watchdog'"):
        exit_with_parent(mechanism="poll")


@pytest.mark.process
def test_sigterm_to_the_parent_alone_stops_its_pool_workers(tmp_path):
    """`kill PID` of a sweep (was: the parent died at once and its spawn-pool workers trained on, orphaned)."""
    with _pool_parent(tmp_path, POOL_ENTRY) as (p, worker):
        p.send_signal(signal.SIGTERM)                    # to the parent only, not its process group
        assert p.wait(timeout=60) == EXIT_INTERRUPTED
        assert p.stderr.read().strip().splitlines()[-1] == "interrupted: signal SIGTERM"
        worker.wait(timeout=30)                          # psutil.TimeoutExpired if it trains on


@pytest.mark.process
def test_usage_errors_keep_argparse_behaviour(tmp_path):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(ENTRY), "ok", "--bogus"], cwd=tmp_path, text=True,
                       capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == EXIT_USER_ERROR and "unrecognized arguments: --bogus" in p.stderr


def test_project_errors_map_to_their_codes():
    from mapl.core.config import ConfigError
    from mapl.base.io import OutputError
    assert exit_code(ConfigError("x")) == exit_code(OutputError("x")) == EXIT_USER_ERROR
    assert exit_code(PermissionError(13, "Permission denied", "c.pt")) == EXIT_USER_ERROR
    assert exit_code(PeerFailure("x")) == EXIT_PEER_FAILED
    assert exit_code(RuntimeError("x")) == exit_code(KeyError("x")) == EXIT_BUG
    assert set(EXIT_CODES) == {0, EXIT_BUG, EXIT_USER_ERROR, EXIT_PEER_FAILED, EXIT_NON_FINITE, EXIT_STEP_FAILED,
                               EXIT_NOT_CONSISTENT, EXIT_INTERRUPTED}


def test_the_machines_os_errors_are_user_errors_with_a_hint():
    """A read-only filesystem, a full disk, a quota or a file-size limit met by any write is the user's to fix (exit 2,
    one line with what to do), never "a bug"; in this checkout the hint is a writable copy. Other OS errors stay bugs."""
    import errno
    from mapl.base.io import CHECKOUT_HINT
    for err in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert exit_code(OSError(err, os.strerror(err), "/mnt/x")) == EXIT_USER_ERROR
    assert exit_code(OSError(errno.EIO, "Input/output error", "/mnt/x")) == EXIT_BUG
    assert error_line(OSError(errno.ENOSPC, "No space left on device", "/mnt/r.pt")) == (
        "error: /mnt/r.pt: No space left on device (the disk is full: free space or choose another folder)")
    inside = str(ROOT / "reports" / "micro")
    assert error_line(OSError(errno.EROFS, "Read-only file system", inside)) == (
        f"error: {inside}: Read-only file system ({CHECKOUT_HINT})")
    assert error_line(FileNotFoundError(errno.ENOENT, "No such file or directory", inside)) == (
        f"error: {inside}: No such file or directory")


def test_label_names_the_rank(capsys):
    def fail(argv):
        raise FloatingPointError("non-finite boundary activation at step 7")
    assert run_cli(fail, [], prog="mapl pipeline", label="rank 2 (stage 2)") == EXIT_NON_FINITE
    assert capsys.readouterr().err == "error: rank 2 (stage 2): non-finite boundary activation at step 7\n"
    assert error_line(KeyboardInterrupt(), label="rank 1") == "interrupted: rank 1"
    assert run_cli(lambda argv: None, ["--debug"], prog="p") == 0


@pytest.mark.process
@pytest.mark.parametrize("args,message", [
    (["--set", "train.steps=abc"], "error: train.steps='abc' is invalid: must be an integer"),
    (["--method", "mapl", "--ratio", "3"], "error: compressor.ratio=3.0 is invalid: d_model=64 / ratio must be"),
    (["--stages", "9"], "error: stages=9 is invalid: must be in [1, n_layers=4]"),
])
def test_train_cli_refuses_a_bad_config_before_importing_torch(tmp_path, args, message):
    """A bad flag or setting costs the CLI's start-up, not a torch import (the fault table's config rows)."""
    code = ("import sys\nfrom mapl.cli import main\ncode = main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")
    p = subprocess.run([sys.executable, "-c", code, "train", "--profile", "micro", *args, "--out", str(tmp_path / "r.json"),
                        "--ckpt", str(tmp_path / "r.pt")], cwd=ROOT, text=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "MAPL_DEBUG": "0"})
    assert p.returncode == EXIT_USER_ERROR and p.stderr.startswith(message), p.stderr
    assert p.stdout.strip() == "no torch"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_sweep_check_and_estimate_need_no_torch(tmp_path):
    """DVC's first stage (`mapl sweep --check`) and `--estimate` read params.yaml and the configs
    only: no torch import (count_params is arithmetic on the config, mapl/core/model_config.py)."""
    code = ("import sys\nfrom mapl.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nprint('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")
    for args, rc in [(["sweep", "--check"], 0), (["sweep", "--estimate"], 0),
                     (["sweep", "--profile", "nope", "--estimate"], 2)]:
        p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, text=True, capture_output=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "MAPL_DEBUG": "0"})
        assert p.returncode == rc, p.stderr
        assert p.stdout.strip().splitlines()[-1] == "no torch", p.stdout


# The commands that stop their own children on a signal (mapl pipeline forwards it to its ranks and leaves by
# os._exit; mapl workspace stops the whole process tree in its copy); every other command goes through run_cli.
OWN_SIGNAL_HANDLING = {"pipeline", "workspace"}


def test_every_command_turns_sigterm_and_errors_into_its_exit_code():
    """Each `mapl <command>` runs under run_cli (or stops its children itself): a command outside it died at once on
    SIGTERM and left its spawn workers training, orphaned (was: mapl sweep, data, reuse, memory, peer)."""
    import ast
    import mapl.cli as cli
    missing = []
    for name, (module, _) in sorted(cli.COMMANDS.items()):
        if module in OWN_SIGNAL_HANDLING:
            continue
        path = ROOT / "mapl" / "cli" / f"{module}.py"
        tree = ast.parse(path.read_text())
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        if not any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "run_cli" for n in ast.walk(main)):
            missing.append(name)
    assert not missing, f"commands whose main does not call run_cli: {missing}"


def test_sigterm_to_a_sweep_is_exit_130_with_one_line(monkeypatch, capsys):
    from mapl.cli import sweep as sweep_cli
    from mapl.orchestration import sweep

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)                                   # the handler raises here
        raise AssertionError("SIGTERM did not stop the sweep")

    def unhandled(signum, frame):                     # without run_cli SIGTERM would end pytest itself
        raise AssertionError("SIGTERM reached mapl sweep outside run_cli")

    monkeypatch.setattr(sweep, "sweep", stopped)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert sweep_cli.main(["--group", "main"]) == EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted: signal SIGTERM"]


@pytest.mark.process
def test_a_reader_that_closes_the_pipe_is_no_error():
    """`mapl sweep --estimate | head -1` (was: a BrokenPipeError traceback reported as a bug). `true` reads nothing and
    is gone before the command has imported, so every write meets a closed pipe."""
    p = subprocess.run(f"{sys.executable} -m mapl.cli sweep --estimate | true; echo ${{PIPESTATUS[0]}}", shell=True, cwd=ROOT,
                       text=True, capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       executable="/bin/bash")
    assert p.stdout.strip() == "0" and p.stderr == "", p.stderr
