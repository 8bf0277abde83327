"""Starting the P x R stage processes of ``mapl pipeline``: directly, or under accelerate or torchrun.

Every rank writes its exit status to ``$MAPL_STATUS_DIR/rank<r>.json``; when every rank stopped on a signal
(checkpoints written) the outcome is 130 even where the launcher reports a failure. docs/pipeline.md says more.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base.cli import EXIT_PEER_FAILED
from ..base.io import owned_temp_folder
from ..core.config import PROJECT_ROOT
from ..core.runtime.rank_status import read_statuses

__all__ = ["LaunchResult", "launch", "launch_machines", "free_port", "child_env", "launcher_command", "RANK_COMMAND",
           "INTERRUPTED"]

INTERRUPTED = 130          # exit code of a graceful stop (a signal: the step finished, checkpoints written)
LAUNCHERS = ("direct", "accelerate", "torchrun")
# what every rank runs after the interpreter (or as a launcher's module): `mapl pipeline`, with no script needed on PATH
RANK_COMMAND = ("-m", "mapl.cli.pipeline")


@dataclass
class LaunchResult:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    rank_returncodes: list = field(default_factory=list)     # launcher="direct" only
    rank_exit_s: list = field(default_factory=list)          # seconds from start to each rank's exit
    stopped: list = field(default_factory=list)              # ranks stopped by the launcher after ``grace_s``
    statuses: dict = field(default_factory=dict)             # rank -> {"status", "code", "message"}
    launcher_returncode: int | None = None                   # what accelerate/torchrun itself returned


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(env: dict | None = None) -> dict:
    import torch
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("HF_DATASETS_OFFLINE", "1")
    e.setdefault("PYTHONUNBUFFERED", "1")
    if not torch.cuda.is_available():
        e["ACCELERATE_USE_CPU"] = "true"
    e.update(env or {})
    return e


def launcher_command(launcher: str, nprocs: int, port: int, module_args: list[str], *, machines: int = 1,
                     machine_rank: int = 0, host: str = "127.0.0.1") -> list[str]:
    """The command line of ``launcher`` for ``nprocs`` processes in all (over ``machines`` machines)."""
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nprocs),
                "--num_machines", str(machines), "--machine_rank", str(machine_rank), "--main_process_ip", host,
                "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", *module_args]
    if launcher == "torchrun":
        if machines == 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
                    *module_args]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(machines), "--node_rank",
                str(machine_rank), "--nproc_per_node", str(nprocs // machines), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{host}:{port}", *module_args]
    raise ValueError(f"launcher={launcher!r} is invalid: allowed {list(LAUNCHERS)}")


def _outcome(rank_codes: list[int], statuses: dict, nprocs: int, launcher_code: int | None) -> int:
    if len(statuses) == nprocs and all(s["status"] == "interrupted" for s in statuses.values()):
        return INTERRUPTED
    if rank_codes:
        first = next((c for c in rank_codes if c != 0), 0)
        # a rank killed by a signal (Popen's -N; as an exit status 256 - N, e.g. 247) failed as a peer: exit 3
        return EXIT_PEER_FAILED if first < 0 else first
    return launcher_code if launcher_code is not None else 1


def launch(cfg_args: list[str], nprocs: int, port: int | None = None, *, launcher: str = "accelerate",
           env: dict | None = None, timeout: float | None = None, cwd: Path | None = None,
           stream: bool = False, grace_s: float | None = None) -> LaunchResult:
    """Run ``mapl pipeline <cfg_args>`` as ``nprocs`` processes and wait for them (``stream``: output not captured).
    ``grace_s`` (direct): once a rank has ended, the others still running this much later are stopped."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is invalid: allowed {list(LAUNCHERS)}")
    port = port or free_port()
    status_dir = owned_temp_folder("mapl-status")
    env = child_env({**(env or {}), "MAPL_STATUS_DIR": status_dir})
    module_args = [*RANK_COMMAND, *map(str, cfg_args)]
    t0 = time.time()
    if launcher == "direct":
        res = _run_direct([sys.executable, *module_args], nprocs, port, env, cwd or PROJECT_ROOT, timeout, stream,
                          grace_s)
    else:
        res = _run_launcher(launcher_command(launcher, nprocs, port, module_args), env, cwd or PROJECT_ROOT, timeout,
                            stream)
    res.wall_s = time.time() - t0
    res.statuses = read_statuses(Path(status_dir))
    # the exit codes of the ranks that ended by themselves say why the run ended, not a launcher's SIGKILL
    own = [c for r, c in enumerate(res.rank_returncodes) if r not in res.stopped]
    res.returncode = _outcome(own or res.rank_returncodes, res.statuses, nprocs, res.launcher_returncode)
    shutil.rmtree(status_dir, ignore_errors=True)
    return res


def launch_machines(cfg_args: list[str], nprocs: int, machines: int, *, launcher: str = "accelerate",
                    env: dict | None = None, timeout: float | None = None, cwd: Path | None = None) -> LaunchResult:
    """Rehearse a multi-machine launch on this host: one launcher per "machine", all on loopback."""
    port = free_port()
    status_dir = owned_temp_folder("mapl-status")
    env = child_env({**(env or {}), "MAPL_STATUS_DIR": status_dir})
    module_args = [*RANK_COMMAND, *map(str, cfg_args)]
    t0 = time.time()
    cmds = [launcher_command(launcher, nprocs, port, module_args, machines=machines, machine_rank=k)
            for k in range(machines)]
    procs = [subprocess.Popen(c, cwd=cwd or PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in cmds]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=None if timeout is None else max(1.0, timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    res = LaunchResult(cmds, 0, "".join(o for o, _ in outs), "".join(e for _, e in outs), time.time() - t0,
                       launcher_returncode=next((p.returncode for p in procs if p.returncode), 0))
    res.statuses = read_statuses(Path(status_dir))
    res.returncode = _outcome([], res.statuses, nprocs, res.launcher_returncode)
    shutil.rmtree(status_dir, ignore_errors=True)
    return res


def _run_launcher(cmd, env, cwd, timeout, stream) -> LaunchResult:
    pipe = None if stream else subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    except KeyboardInterrupt:          # Ctrl-C: the launcher shuts its ranks down; wait for it
        out, err = proc.communicate()
    return LaunchResult(cmd, proc.returncode, out or "", err or "", 0.0, launcher_returncode=proc.returncode)


def _run_direct(cmd, nprocs, port, env, cwd, timeout, stream, grace_s=None) -> LaunchResult:
    procs, files = [], []
    for r in range(nprocs):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        fo, fe = (None, None) if stream else (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        files.append((fo, fe))
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=e, stdout=fo, stderr=fe, text=True))
    exit_s, stopped = _wait_all(procs, timeout, time.time(), grace_s)
    outs, errs = [], []
    for r, (fo, fe) in enumerate(files):
        if fo is None:
            continue
        for f, sink in ((fo, outs), (fe, errs)):
            f.seek(0)
            sink.append("".join(f"[rank {r}] {line}" for line in f.read().splitlines(True)))
            f.close()
    return LaunchResult(cmd, 0, "".join(outs), "".join(errs), 0.0, [p.returncode for p in procs], exit_s,
                        stopped=stopped)


def _stop(procs, ranks: list[int], wait_s: float = 5.0) -> None:
    """SIGTERM (a graceful stop where the rank can still act on it), then SIGKILL (a stopped or blocked rank)."""
    for r in ranks:
        procs[r].terminate()
    deadline = time.time() + wait_s
    for r in ranks:
        try:
            procs[r].wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            procs[r].kill()
            procs[r].wait()


def _wait_all(procs, timeout, t0, grace_s=None) -> tuple[list, list]:
    """Wait for every rank, passing SIGTERM on (a second Ctrl-C kills them); returns (exit times, stopped ranks)."""
    exit_s, stopped = [None] * len(procs), []
    interrupts = []

    def forward(signum, frame):
        if signum == signal.SIGINT:
            interrupts.append(time.time())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if len(interrupts) > 1 else signal.SIGTERM)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        while any(x is None for x in exit_s):
            for r, p in enumerate(procs):
                if exit_s[r] is None and p.poll() is not None:
                    exit_s[r] = time.time() - t0
            if timeout is not None and time.time() - t0 > timeout:
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                        exit_s[r] = time.time() - t0
                break
            ended = [x for x in exit_s if x is not None]
            if grace_s is not None and ended and time.time() - t0 > min(ended) + grace_s:
                stopped = [r for r, x in enumerate(exit_s) if x is None]
                _stop(procs, stopped)
                for r in stopped:
                    exit_s[r] = time.time() - t0
                break
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return exit_s, stopped

