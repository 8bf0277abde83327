"""Every fault a run can meet, through the real command line: ONE table (``FAULTS``), one test.

Each row runs ``mapl <command>`` as a subprocess on the micro profile (a small local
byte-level corpus: nothing is downloaded, ``../shared/data`` is not needed) in a folder of its own,
and checks what a user sees and keeps:

(a) the exit code ``mapl.base.cli`` documents: 0 done, 1 a bug (traceback), 2 user error, 3 a peer of the
    multi-process pipeline failed or timed out, 4 non-finite values, 130 interrupted;
(b) stderr holds no traceback, and the error is ONE line matching the row's pattern (argparse's own
    usage lines may come before it; the multi-process pipeline prints one line per rank and the
    launcher's summary, each matching ``error:``/``interrupted:``/``MAPL_FAULT:``);
(c) nothing is lost or silently overwritten: every file of the folder before the run is
    byte-identical after it (except what the row lists under ``changes``), no temp file and no
    output lock is left, and no other new file appears (except the row's ``creates`` and the data
    folder's own verification stamps and lock files);
(d) where the row has one, its recovery command then succeeds (exit 0).

The table is also the source of docs/failure-modes.md (``python tests/test_faults.py > docs/failure-modes.md``;
a test keeps the two in step). Rows with ``bug`` are known bugs in training sources this change may
not touch: a strict xfail whose failure is raised as ``KnownBug`` on exactly the listed properties
(every other property still fails the test as usual). Rows marked ``slow`` start the multi-process
pipeline, or repeat a fault class that a fast row already covers. ``make test`` runs the rows marked
``before_torch`` and not ``slow``: the command ends before it imports torch (interpreter start-up and the checks,
0.3-0.7 CPU-seconds a row, measured). Every other row is marked ``full`` and runs in ``make test-all``: its command
imports torch (3-5 CPU-seconds before it does anything) and most then train, resume or start pipeline ranks.

Related unit tests (in process, finer grained): tests/test_validation.py (every config value),
tests/test_io.py (atomic writes, locks, disk full), tests/test_train.py (resume, non-finite),
tests/test_data.py (shards), tests/test_runtime_faults.py and tests/test_pipeline.py (multi-process).
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

PROJECT = Path(__file__).resolve().parents[1]
MAPL = [sys.executable, "-m", "mapl.cli"]          # the `mapl` command
NOBODY = 65534


class KnownBug(AssertionError):
    """A property a row lists under ``bug`` does not hold (the row is a strict xfail raising this)."""


# ---- the harness --------------------------------------------------------------------------------------
@dataclass
class Ctx:
    """One row's folder (the command's working directory) and what the checks found."""
    dir: Path
    data: Path                      # the prepared data folder the run reads
    glob: str                       # the corpus files (for data.paths and `mapl data`)
    bug: frozenset
    seeds: Path                     # finished runs, trained once per session (``seed``)
    pythonpath: Path = PROJECT
    procs: list = field(default_factory=list)       # helper processes (a lock holder) to stop at the end
    env_extra: dict = field(default_factory=dict)   # set by a setup for the row's command (e.g. its rank)
    procs_stopped: list = field(default_factory=list)   # rank processes a row SIGSTOPped (psutil.Process)
    stdout: str = ""                # stdout read while the command ran (``during``)
    failures: list = field(default_factory=list)    # (property, message)

    def expect(self, prop: str, ok: bool, message: str) -> bool:
        if not ok:
            self.failures.append((prop, message))
        return ok

    def verdict(self) -> None:
        real = [m for p, m in self.failures if p not in self.bug]
        if real:
            raise AssertionError("\n".join(real))
        if self.failures:
            raise KnownBug("\n".join(m for _, m in self.failures))

    def argv(self, cmd: str) -> list[str]:
        """``"mapl train @run --steps 2"`` -> the subprocess argv; ``@run`` is the micro profile on the
        local corpus; ``{dir}``, ``{data}``, ``{glob}``, ``{project}`` (this checkout) are filled in. ``mapl``
        is run as ``python -m mapl.cli`` (what its script runs), so the code is ``pythonpath``'s."""
        mapl, command, *args = shlex.split(cmd)
        assert mapl == "mapl", f"{cmd}: a row's command is `mapl <command> ...`"
        run = ["--profile", "micro", "--set", "data.source=text", "--set", f"data.paths={json.dumps([self.glob])}",
               "--set", "data.tokenizer=byte", "--set", f"data_dir={self.data}", "--set", "train.threads=1",
               "--no-progress"]
        out = []
        for a in args:
            out += run if a == "@run" else [a.format(dir=self.dir, data=self.data, glob=self.glob, project=PROJECT)]
        if command in ("train", "pipeline"):     # never the project's default output folders
            assert "--out" in out and "--ckpt" in out, f"{cmd}: give --out and --ckpt"
        return [*MAPL, command, *out]

    def env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHONPATH=str(self.pythonpath), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
                   OMP_NUM_THREADS="1", MAPL_DEBUG="0", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   **(extra or {}))
        return {k: v for k, v in env.items() if v is not None}      # None: the variable is unset (`env -u`)

    def start(self, cmd: str, env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(cmd), cwd=self.dir, env=self.env(env), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, **kw)

    def run(self, cmd: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd), cwd=self.dir, env=self.env(env), text=True, capture_output=True,
                              timeout=timeout)

    def read_until(self, p: subprocess.Popen, pattern: str, timeout: float = 600, keep: bool = True) -> bool:
        """Read a process's stdout until a line matches ``pattern`` (False if it ended first); ``keep``:
        the text read is the row's command's (checked with the rest of its stdout)."""
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        seen = ""
        try:
            for line in p.stdout:
                seen += line
                if re.search(pattern, line):
                    return True
            return self.expect("during", False, f"the process ended before printing /{pattern}/:\n{seen[-3000:]}"
                                                f"\n{p.stderr.read()[-3000:] if p.poll() is not None else ''}")
        finally:
            timer.cancel()
            if keep:
                self.stdout += seen


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (dotfiles included)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _matches(rel: str, patterns) -> bool:
    return any(fnmatch.fnmatch(rel, pat) for pat in patterns)


# the data folder's own bookkeeping (host verification stamps, persistent flock files): not outputs
DATA_BOOKKEEPING = ("*.verified-*.json", "*.verified-*.json.lock", "*.prepare.lock")


def check_files(ctx: Ctx, before: dict, changes=(), creates=(), when: str = "") -> None:
    after = snapshot(ctx.dir)
    for rel, digest in before.items():
        if _matches(rel, changes):
            continue
        if rel not in after:
            ctx.expect("files", False, f"{when}{rel} was lost")
        else:
            ctx.expect("files", after[rel] == digest, f"{when}{rel} was overwritten")
    for rel in sorted(set(after) - set(before)):
        if rel.endswith(".tmp"):
            ctx.expect("files", False, f"{when}temp file left: {rel}")
        elif not _matches(rel, (*creates, *DATA_BOOKKEEPING)):
            ctx.expect("files", False, f"{when}unexpected new file: {rel}")


def check_stderr(ctx: Ctx, err: str, mode: str, line) -> None:
    ctx.expect("stderr", "Traceback" not in err, f"a traceback on stderr:\n{err[-3000:]}")
    lines = [x for x in err.splitlines() if x.strip()]
    patterns = [line] if isinstance(line, str) else list(line)
    if mode == "one":
        ctx.expect("stderr", len(lines) == 1, f"stderr is not one line:\n{err[-3000:]}")
    elif mode == "usage":           # argparse: "usage: ..." (wrapped, indented), then "prog: error: ..."
        ctx.expect("stderr", bool(lines) and lines[0].startswith("usage:") and
                   all(x.startswith(" ") for x in lines[1:-1]), f"not argparse's usage + one error line:\n{err}")
        lines = lines[-1:]
    elif mode == "any":             # a command that succeeds and logs what it did (no traceback is all)
        pass
    else:                           # "ranks": one line per rank and the launcher's summary
        stray = [x for x in lines if not re.match(r"(error|interrupted|MAPL_FAULT): ", x)]
        ctx.expect("stderr", not stray, f"stderr lines that are no rank's one-line report: {stray}")
    for pat in patterns:
        ctx.expect("stderr", any(re.search(pat, x) for x in lines), f"no stderr line matches /{pat}/:\n{err[-3000:]}")


# ---- what rows set up ---------------------------------------------------------------------------------
def seed(*flags: str) -> Callable[[Ctx], None]:
    """Setup: r.json and r.pt of a finished run of ``mapl train @run <flags>`` in the row's folder
    (trained once per session, in this process, with the config the CLI builds from the same flags)."""
    def setup(ctx: Ctx) -> None:
        import torch
        import mapl.cli.train as mtrain
        from mapl.core.run import run
        where = ctx.seeds / hashlib.sha256(json.dumps([str(ctx.data), *flags]).encode()).hexdigest()[:16]
        if not (where / "r.json").exists():
            where.mkdir(parents=True, exist_ok=True)
            args = ctx.argv(f"mapl train @run {' '.join(flags)} --out r.json --ckpt r.pt")[len(MAPL) + 1:-4]
            threads = torch.get_num_threads()
            try:
                run(mtrain.config_from_args(mtrain.parse_args(args)), out=where / "r.json",
                           ckpt=where / "r.pt", progress=False, log=lambda *a, **k: None)
            finally:
                torch.set_num_threads(threads)
        for name in ("r.json", "r.pt"):
            shutil.copy2(where / name, ctx.dir / name)
    return setup


def pipeline_run(cmd: str) -> Callable[[Ctx], None]:
    """Setup: the outputs of a finished multi-process run (its per-rank checkpoints and results)."""
    def setup(ctx: Ctx) -> None:
        r = ctx.run(cmd)
        assert r.returncode == 0, f"setup `{cmd}` exited {r.returncode}:\n{r.stderr[-3000:]}"
    return setup


def other_rank(cmd: str, code_edit: str = "") -> Callable[[Ctx], None]:
    """Setup: a pipeline of two processes started by hand, as on two machines: the row's command is rank
    0, ``cmd`` (its own flags) is rank 1; they meet on a free loopback port. ``code_edit``: rank 1 runs a
    copy of the package whose training source ``code_edit`` has one more comment line."""
    def setup(ctx: Ctx) -> None:
        from mapl.orchestration.launch import free_port
        world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        ctx.env_extra.update(world, RANK="0")
        env = ctx.env({**world, "RANK": "1"})
        if code_edit:
            other = ctx.dir.parent / f"{ctx.dir.name}-other-code"
            shutil.copytree(PROJECT / "mapl", other / "mapl", ignore=shutil.ignore_patterns("__pycache__"))
            for name in ("params.yaml", "pyproject.toml"):
                shutil.copy2(PROJECT / name, other / name)
            with open(other / code_edit, "a") as f:
                f.write("# another version of the training code\n")
            env["PYTHONPATH"] = str(other)
        ctx.procs.append(subprocess.Popen(ctx.argv(cmd), cwd=ctx.dir, env=env, text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))
    return setup


def other_rank_refused(pattern: str, code: int = 2) -> Callable:
    """After: the hand-started rank 1 (``other_rank``) ended with ``code`` and one stderr line matching ``pattern``."""
    def after(ctx: Ctx, out: str, err: str) -> None:
        p = ctx.procs[0]
        try:
            _, perr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, perr = p.communicate()
        ctx.expect("code", p.returncode == code, f"rank 1 exited {p.returncode}, not {code}:\n{perr[-3000:]}")
        check_stderr(ctx, perr, "one", pattern)
    return after


def results_folder(damage: Callable[[Path], None]) -> Callable[[Ctx], None]:
    """Setup: ``res/main/`` holding two copies of a finished run's r.json (``seed``), ``b.json`` then damaged."""
    def setup(ctx: Ctx) -> None:
        folder = ctx.dir / "res" / "main"
        folder.mkdir(parents=True)
        for name in ("a.json", "b.json"):
            shutil.copy2(ctx.dir / "r.json", folder / name)
        damage(folder / "b.json")
    return setup


def _nan_val_loss(path: Path) -> None:
    res = json.loads(path.read_text())
    path.write_text(json.dumps({**res, "val_loss": float("nan")}))


def _steps_a_string(path: Path) -> None:
    res = json.loads(path.read_text())
    path.write_text(json.dumps({**res, "steps": "many"}))


def both(*setups) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        for s in setups:
            s(ctx)
    return setup


def write(name: str, content: str | bytes) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        path = ctx.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return setup


def flip_byte(name: str, at: int = 100) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        with open(ctx.dir / name, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
    return setup


def truncate(name: str, keep: int | None = None) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        path = ctx.dir / name
        os.truncate(path, path.stat().st_size // 2 if keep is None else keep)
    return setup


def remove(name: str) -> Callable[[Ctx], None]:
    return lambda ctx: (ctx.dir / name).unlink()


def torch_save(name: str, make: Callable[[], object]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        import torch
        torch.save(make(), ctx.dir / name)
    return setup


def drop_keys(name: str, *keys: str) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        import torch
        ck = torch.load(ctx.dir / name, weights_only=True)
        for k in keys:
            *path, last = k.split(".")
            parent = ck[path[0]] if path else ck
            del parent[last]
        torch.save(ck, ctx.dir / name)
    return setup


def read_only_folder(name: str, keep: str = "old.json") -> Callable[[Ctx], None]:
    """A folder the command may not write (the command runs as ``nobody`` when the tests run as root),
    holding a file that must survive."""
    def setup(ctx: Ctx) -> None:
        folder = ctx.dir / name
        folder.mkdir()
        (folder / keep).write_text('{"earlier": "results"}\n')
        folder.chmod(0o555)
    return setup


def checkout_copy(ctx: Ctx) -> None:
    """Setup: a copy of the checkout's package, params.yaml and dvc.yaml in ``proj/`` that the command imports (its
    PROJECT_ROOT; with ``read_only``, mounted read-only for the command)."""
    proj = ctx.dir / "proj"
    shutil.copytree(PROJECT / "mapl", proj / "mapl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("params.yaml", "dvc.yaml", "pyproject.toml"):
        shutil.copy2(PROJECT / name, proj / name)
    ctx.pythonpath = proj


def _read_only_mount_reason() -> str | None:
    """Why a folder cannot be mounted read-only for one command here (None: it can): a private mount namespace
    (``unshare -m``) and a read-only bind mount need root or user namespaces."""
    if not shutil.which("unshare"):
        return "no `unshare` on this machine"
    probe = tempfile.mkdtemp(prefix="mapl-ro-probe-")
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro {probe} {probe} && ! touch {probe}/x"],
                           capture_output=True, text=True, timeout=30)
        return None if r.returncode == 0 else f"a read-only bind mount is not allowed here ({r.stderr.strip()[:120]})"
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _read_only_argv(folder: Path, argv: list[str]) -> list[str]:
    """``argv`` in a private mount namespace where ``folder`` is mounted over itself read-only (EROFS, as a checkout
    on a read-only medium or a review mount: every file readable, nothing writable; the rest of the machine as is)."""
    return ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder), *argv]


def big_corpus(ctx: Ctx) -> None:
    """Setup: ``big/`` holding 8 text files of 2.4 MB (seconds to encode, so a signal lands mid-preparation)."""
    import random
    rng, words = random.Random(0), "the cat sat on a mat and a dog ran far away home".split()
    (ctx.dir / "big").mkdir()
    for i in range(8):
        (ctx.dir / "big" / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(600_000)))


def signal_when_exists(rel: str, sig=signal.SIGTERM, timeout: float = 120) -> Callable:
    """During: send ``sig`` once the file ``rel`` appears in the row's folder (the command is mid-way)."""
    def during(p: subprocess.Popen, ctx: Ctx) -> None:
        import time
        end = time.monotonic() + timeout
        while not (ctx.dir / rel).exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if p.poll() is None:
            p.send_signal(sig)
    return during


def signal_tree_when_exists(rel: str, sig=signal.SIGINT, timeout: float = 300) -> Callable:
    """During: once the file ``rel`` appears in the row's folder (the command is mid-way), note every process
    below the command, then send it ``sig``; ``after`` (``tree_gone``) checks they are all gone."""
    def during(p: subprocess.Popen, ctx: Ctx) -> None:
        import time

        import psutil
        end = time.monotonic() + timeout
        while not (ctx.dir / rel).exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if p.poll() is None:
            ctx.procs_stopped.extend(psutil.Process(p.pid).children(recursive=True))
            p.send_signal(sig)
    return during


def prepared(folder: str) -> Callable:
    """Recovered: ``folder`` holds a complete preparation (its manifest) and no work folder."""
    def check(ctx: Ctx, out: str, err: str) -> None:
        ctx.expect("recover", (ctx.dir / folder / "manifest.json").is_file(), f"no manifest in {folder} after the rerun")
        ctx.expect("recover", not (ctx.dir / folder / ".partial").exists(), f"{folder}/.partial left after the rerun")
    return check


def lone_rank(ctx: Ctx) -> None:
    """Setup: the row's command is rank 0 of two started by hand; rank 1 is not started (it starts late, after)."""
    from mapl.orchestration.launch import free_port
    ctx.env_extra.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port()))


def late_rank(cmd: str, bound_s: float) -> Callable:
    """After: rank 1 started now, after rank 0 gave up, gives up too: exit 3 within ``bound_s`` seconds, one line."""
    def after(ctx: Ctx, out: str, err: str) -> None:
        import time
        start = time.monotonic()
        r = ctx.run(cmd, env={**ctx.env_extra, "RANK": "1"}, timeout=bound_s + 60)
        took = time.monotonic() - start
        ctx.expect("code", r.returncode == 3, f"the late rank 1 exited {r.returncode}, not 3:\n{r.stderr[-3000:]}")
        ctx.expect("code", took < bound_s, f"the late rank 1 took {took:.0f} s, over its bound of {bound_s:.0f} s")
        check_stderr(ctx, r.stderr, "one", r"^error: rank 1: the process group did not form within 5 s ")
    return after


def params_yaml(edit: Callable[[dict], dict] | str | None) -> Callable[[Ctx], None]:
    """A copy of the package whose params.yaml is edited (a dict edit), replaced (text) or missing (None);
    the command imports that copy."""
    def setup(ctx: Ctx) -> None:
        import yaml
        proj = ctx.dir / "proj"
        shutil.copytree(PROJECT / "mapl", proj / "mapl", ignore=shutil.ignore_patterns("__pycache__"))
        if isinstance(edit, str):
            (proj / "params.yaml").write_text(edit)
        elif edit is not None:
            params = yaml.safe_load((PROJECT / "params.yaml").read_text())
            (proj / "params.yaml").write_text(yaml.safe_dump(edit(params)))
        ctx.pythonpath = proj
    return setup


def _set_in(path: str, value) -> Callable[[dict], dict]:
    def edit(params: dict) -> dict:
        node = params
        *head, last = path.split(".")
        for k in head:
            node = node[k]
        node[last] = value
        return params
    return edit


# ---- what rows do while the command runs, and check after it ------------------------------------------
def signal_after(pattern: str, sig=signal.SIGINT) -> Callable:
    def during(p: subprocess.Popen, ctx: Ctx) -> None:
        if ctx.read_until(p, pattern):
            p.send_signal(sig)
    return during


def truncate_after(pattern: str, name: str, keep: int = 64) -> Callable:
    def during(p: subprocess.Popen, ctx: Ctx) -> None:
        if ctx.read_until(p, pattern):
            os.truncate(ctx.dir / name, keep)
    return during


def _rank_process(p: subprocess.Popen, rank: int):
    """The child process of the self-launched pipeline ``p`` that runs ``rank`` (psutil, by its RANK)."""
    import psutil
    for child in psutil.Process(p.pid).children():
        with contextlib.suppress(psutil.Error):
            if child.environ().get("RANK") == str(rank):
                return child
    return None


def sigstop_rank_after(pattern: str, rank: int) -> Callable:
    """During: once ``pattern`` is printed, ``rank``'s process is stopped (SIGSTOP: it answers nothing and
    acts on no signal but SIGKILL); ``after`` checks that it is gone."""
    def during(p: subprocess.Popen, ctx: Ctx) -> None:
        if ctx.read_until(p, pattern):
            child = _rank_process(p, rank)
            if ctx.expect("during", child is not None, f"no process of rank {rank} under {p.pid}"):
                child.send_signal(signal.SIGSTOP)
                ctx.procs_stopped.append(child)
    return during


def stopped_ranks_are_gone(ctx: Ctx, out: str, err: str) -> None:
    for child in ctx.procs_stopped:
        ctx.expect("files", not child.is_running() or child.status() == "zombie",
                   f"the stopped rank (PID {child.pid}) is still there")


def port_held(rank: int = 1, world: int = 2) -> Callable[[Ctx], None]:
    """Setup: another program listens on a free port; the row's command is ``rank`` of a pipeline of
    ``world`` started by hand with MASTER_PORT set to that port."""
    def setup(ctx: Ctx) -> None:
        code = ("import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen(8)\n"
                "print(s.getsockname()[1], flush=True)\ntime.sleep(600)")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        ctx.procs.append(p)
        ctx.env_extra.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=p.stdout.readline().strip())
    return setup


def signal_tree_after(pattern: str, sig=signal.SIGTERM) -> Callable:
    """During: once ``pattern`` is printed, note every process below the command, then send it ``sig``;
    ``after`` (``tree_gone``) checks they are all gone."""
    def during(p: subprocess.Popen, ctx: Ctx) -> None:
        import psutil
        if ctx.read_until(p, pattern):
            ctx.procs_stopped.extend(psutil.Process(p.pid).children(recursive=True))
            p.send_signal(sig)
    return during


def tree_gone(ctx: Ctx, out: str, err: str) -> None:
    ctx.expect("files", bool(ctx.procs_stopped), "no process was seen below the command")
    stopped_ranks_are_gone(ctx, out, err)
    left = list((ctx.dir / "tmp").iterdir())
    ctx.expect("files", not left, f"the temporary copy was left: {left}")


def holder(cmd: str, pattern: str) -> Callable[[Ctx], None]:
    """Setup: another real run on the same output paths, training when the row's command starts."""
    def setup(ctx: Ctx) -> None:
        p = ctx.start(cmd)
        ctx.procs.append(p)
        ctx.read_until(p, pattern, keep=False)
    return setup


def stop_holder(ctx: Ctx, out: str, err: str) -> None:
    """After: the refused run named the holder's PID; the holder then stops gracefully (130) and keeps its
    checkpoint; its lock files are gone."""
    import torch
    p = ctx.procs[0]
    ctx.expect("stderr", f"in use by PID {p.pid} (" in err, f"the holder's PID {p.pid} is not named: {err}")
    p.send_signal(signal.SIGINT)
    _, herr = p.communicate(timeout=120)
    ctx.expect("holder", p.returncode == 130, f"the holder ended with {p.returncode}: {herr[-2000:]}")
    ctx.expect("holder", torch.load(ctx.dir / "r.pt", weights_only=True)["state"]["step"] >= 2, "holder's checkpoint")
    ctx.expect("files", not list(ctx.dir.glob("*.lock")), f"lock files left: {list(ctx.dir.glob('*.lock'))}")


def checkpoint_step(name: str, low: int, high: int, finite: bool = False) -> Callable:
    """After: ``name`` is a checkpoint of a step in [low, high) (and holds only finite values)."""
    def after(ctx: Ctx, out: str, err: str) -> None:
        import torch
        ck = torch.load(ctx.dir / name, weights_only=True)
        step = ck["state"]["step"]
        ctx.expect("files", low <= step < high, f"{name} holds step {step}, not in [{low}, {high})")
        if finite:
            bad = [k for k, v in ck["model"].items() if isinstance(v, torch.Tensor) and v.is_floating_point()
                   and not torch.isfinite(v).all()]
            ctx.expect("files", not bad, f"{name} holds non-finite {bad}")
    return after


def stdout_has(pattern: str) -> Callable:
    def after(ctx: Ctx, out: str, err: str) -> None:
        ctx.expect("stdout", re.search(pattern, out) is not None, f"stdout has no /{pattern}/:\n{out[-3000:]}")
    return after


def results_steps(steps: int, resumed: bool = False) -> Callable:
    def after(ctx: Ctx, out: str, err: str) -> None:
        res = json.loads((ctx.dir / "r.json").read_text())
        ctx.expect("recover", res["steps"] == steps, f"r.json has {res['steps']} steps, not {steps}")
        if resumed:
            ctx.expect("recover", bool(res["resumed_with_changes"]), "the resume with changes is not recorded")
    return after


WS_RUN = "micro-P2-mapl-4x-40steps-s0"          # a micro run of group long: 40 steps, a checkpoint every 10
WS_CKPT = f"checkpoints/micro/{WS_RUN}.pt"


def interrupted_mid_run(ctx: Ctx, out: str, err: str) -> None:
    """After (a workspace's training interrupted): no process is left, the run's checkpoint holds a step before its
    last and it wrote no result."""
    tree_gone(ctx, out, err)
    checkpoint_step(f"ws/{WS_CKPT}", 10, 40)(ctx, out, err)
    done = ctx.dir / f"ws/reports/micro/results/long/{WS_RUN}.json"
    ctx.expect("files", not done.exists(), f"{done} was written: the run was not interrupted mid-way")


def resumed_in_workspace(ctx: Ctx, out: str, err: str) -> None:
    """Recovered: the rerun resumed the interrupted run from its checkpoint and finished it."""
    said = re.search(r"resumed \S+ at step (\d+)", out + err)
    ctx.expect("recover", bool(said) and int(said.group(1)) >= 10, f"the rerun resumed nothing:\n{(out + err)[-3000:]}")
    res = ctx.dir / f"ws/reports/micro/results/long/{WS_RUN}.json"
    ctx.expect("recover", res.is_file() and json.loads(res.read_text())["steps"] == 40, f"{res}: no 40-step result")


REL = "fault-relative-outputs"          # a folder name the project never has


def outputs_in_the_working_folder(ctx: Ctx, out: str, err: str) -> None:
    """After (pipeline, relative paths): the outputs are in the user's working folder (and none in the project)."""
    stray = PROJECT / REL
    try:
        ctx.expect("files", (ctx.dir / REL / "r.json").exists() and not stray.exists(),
                   f"--out {REL}/r.json was not written to {ctx.dir}/{REL}/ but to {stray}: {out[-1000:]}")
    finally:
        shutil.rmtree(stray, ignore_errors=True)


# ---- the table ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    name: str
    fault: str                      # what the user did or what went wrong
    cmd: str                        # "<module> <args>" (see Ctx.argv)
    code: int
    line: str | tuple               # regex(es) the stderr line(s) must match
    shows: str                      # the message as the user reads it (docs/failure-modes.md)
    happens: str                    # what the command does (docs/failure-modes.md)
    kept: str                       # what stays on disk (docs/failure-modes.md)
    fix: str                        # how to go on (docs/failure-modes.md)
    stderr: str = "one"             # one | usage | ranks | any (a success that logs)
    setup: Callable | None = None
    during: Callable | None = None
    after: Callable | None = None
    changes: tuple = ()             # files the command may change (globs relative to the row's folder)
    creates: tuple = ()             # new files the command may write
    recover: tuple = ()             # commands that must then exit 0, in order
    recovered: Callable | None = None
    env: dict = field(default_factory=dict)
    file_size_limit: int = 0        # RLIMIT_FSIZE of the command (bytes), like `ulimit -f`
    as_nobody: bool = False         # the command drops root (folder permissions apply)
    read_only: str = ""             # a folder of the row's (e.g. a checkout copy) the command sees mounted read-only
    own_data: bool = False          # a private copy of the prepared data in <folder>/data
    timeout: float = 600             # seconds per command (a loaded 2-core machine can starve the pipeline)
    exit_text: str = ""             # docs/failure-modes.md's exit cell, when not just ``code``
    slow: bool = False
    before_torch: bool = False      # the command ends before importing torch: in `make test` (else `full`)
    bug: tuple = ()                 # properties known to fail: code, stderr, files, recover
    reason: str = ""                # the bug, for the xfail


T = "mapl train @run"
IO = "--out r.json --ckpt r.pt"
MP = "mapl pipeline @run --out {dir}/r.json --ckpt {dir}/r.pt"
TOO_LONG = "--set train.eval_every=1 --set train.eval_tokens=64 --set train.checkpoint_every=100000"
REBUILD = "mapl data --out data --source text --paths {glob} --tokenizer byte --rebuild"
ERR = "error: "
RO_HINT = (r"\(this checkout is not writable: run in a writable copy, e\.g\. `mapl workspace repro --profile P --dir "
           r"\.\./mapl-P`, or give output paths outside it\)$")       # mapl.base.io.CHECKOUT_HINT
HASH = "[0-9a-f]{64}"

FAULTS = [
    # ---- configuration: flags, --set, params.yaml ---------------------------------------------------
    Fault("set-wrong-type", "`--set` value of the wrong type (`train.steps=abc`)", f"{T} --set train.steps=abc {IO}", 2,
          r"^error: train\.steps='abc' is invalid: must be an integer$",
          "error: train.steps='abc' is invalid: must be an integer",
          "refused before any data or model is touched", "nothing written", "fix the value", before_torch=True),
    Fault("set-out-of-range", "a value out of its range (`--set train.grad_clip=-1`)",
          f"{T} --set train.grad_clip=-1 {IO}", 2, r"^error: train\.grad_clip=-1\.0 is invalid: must be >= 0$",
          "error: train.grad_clip=-1.0 is invalid: must be >= 0",
          "refused before any work", "nothing written", "fix the value", before_torch=True),
    Fault("warmup-longer-than-run", "a warm-up longer than the run (`--set train.warmup_steps=5 --steps 2`; was: "
          "accepted, and the run never left its warm-up)", f"{T} --steps 2 --set train.warmup_steps=5 {IO}", 2,
          r"^error: train\.warmup_steps=5 is invalid: must be <= train\.steps=2 \(a longer warm-up never reaches the "
          r"peak learning rate\)$",
          "error: train.warmup_steps=5 is invalid: must be <= train.steps=2 (a longer warm-up never reaches the peak "
          "learning rate)", "refused before any work", "nothing written", "fix the value", before_torch=True),
    Fault("seed-negative", "a flag out of its range (`--seed -1`)", f"{T} --seed -1 {IO}", 2,
          r"^error: train\.seed=-1 is invalid: must be >= 0$", "error: train.seed=-1 is invalid: must be >= 0",
          "refused before any work", "nothing written", "fix the value", slow=True, before_torch=True),
    Fault("ratio-nan", "a non-finite number (`--ratio nan`)", f"{T} --method mapl --ratio nan {IO}", 2,
          r"^error: compressor\.ratio=nan is invalid: must be a finite number$",
          "error: compressor.ratio=nan is invalid: must be a finite number",
          "refused before any work", "nothing written", "fix the value", before_torch=True),
    Fault("ratio-unreachable", "a ratio no integer rank gives (`--ratio 3` at d = 64)",
          f"{T} --method mapl --ratio 3 {IO}", 2,
          r"^error: compressor\.ratio=3\.0 is invalid: .*reachable ratios divide 64",
          "error: compressor.ratio=3.0 is invalid: ... reachable ratios divide 64 ...",
          "refused before any work", "nothing written", "pick an allowed ratio", slow=True, before_torch=True),
    Fault("set-section", "`--set` on a whole section (`--set train=5`)", f"{T} --set train=5 {IO}", 2,
          r"^error: 'train' is a section: set one of its keys, e.g\. train\.steps=\.\.\.$",
          "error: 'train' is a section: set one of its keys, e.g. train.steps=...",
          "refused (no longer silently ignored)", "nothing written", "set a key of the section", before_torch=True),
    Fault("lr-negative", "a negative learning rate", f"{T} --set train.lr_muon=-0.02 {IO}", 2,
          r"^error: train\.lr_muon=-0\.02 is invalid: must be >= 0$",
          "error: train.lr_muon=-0.02 is invalid: must be >= 0",
          "refused before any work", "nothing written", "fix the value", slow=True, before_torch=True),
    Fault("set-unknown-key", "an unknown key (`--set train.lr_magic=1`)", f"{T} --set train.lr_magic=1 {IO}", 2,
          r"^error: 'train\.lr_magic': train has no key 'lr_magic'; allowed: \[.*'lr_muon'.*\]$",
          "error: 'train.lr_magic': train has no key 'lr_magic'; allowed: [...]",
          "refused before any work", "nothing written", "use an allowed key", before_torch=True),
    Fault("set-unknown-section", "an unknown section (`--set magic.key=1`)", f"{T} --set magic.key=1 {IO}", 2,
          r"^error: 'magic\.key' is not a setting: allowed sections \[", "error: 'magic.key' is not a setting: "
          "allowed sections [...]", "refused before any work", "nothing written", "use an allowed section", slow=True,
          before_torch=True),
    Fault("set-malformed", "`--set` without `=`", f"{T} --set train.steps {IO}", 2,
          r"^error: --set 'train\.steps' is invalid: expected SECTION\.KEY=VALUE",
          "error: --set 'train.steps' is invalid: expected SECTION.KEY=VALUE, e.g. ...",
          "refused before any work", "nothing written", "write KEY=VALUE", slow=True, before_torch=True),
    Fault("checkpoint-every-zero", "`--set train.checkpoint_every=0` (was a ZeroDivisionError after a step)",
          f"{T} --set train.checkpoint_every=0 {IO}", 2,
          r"^error: train\.checkpoint_every=0 is invalid: must be >= 1$",
          "error: train.checkpoint_every=0 is invalid: must be >= 1",
          "refused before any work", "nothing written", "fix the value", before_torch=True),
    Fault("eval-offset-beyond-data", "`eval_offset` past the validation split",
          f"{T} --set train.eval_offset=100000000 {IO}",
          2, r"^error: train\.eval_offset=100000000 is invalid: the validation split has \d+ tokens, so it must be "
             r"<= \d+ \(validation windows of train\.seq_len=32\)$",
          "error: train.eval_offset=100000000 is invalid: the validation split has N tokens, so it must be <= M ...",
          "refused once the data is opened, before the model is built", "nothing written", "fix the value"),
    Fault("eval-tokens-beyond-data", "`eval_tokens` above the validation split (was: read as the whole split, "
          "silently)", f"{T} --set train.eval_tokens=100000000 {IO}",
          2, r"^error: train\.eval_tokens=100000000 is invalid: the validation split has \d+ tokens from "
             r"train\.eval_offset=0 on, so it must be <= \d+, or 0 for the whole split$",
          "error: train.eval_tokens=100000000 is invalid: the validation split has N tokens from train.eval_offset=0 "
          "on, so it must be <= N, or 0 for the whole split",
          "refused once the data is opened, before the model is built", "nothing written", "fix the value",
          slow=True),
    Fault("run-name-path", "a run name that is a path (`--set run_name=../x`; was: its checkpoint written "
          "outside checkpoints/)", f"{T} --set run_name=../x {IO}", 2,
          r"^error: run_name='\.\./x' is invalid: allowed letters, digits and \. _ \+ = - \(no path separator, no "
          r"'\.\.': it names the run's checkpoint and results files\)$",
          "error: run_name='../x' is invalid: allowed letters, digits and . _ + = - (no path separator, no '..': it "
          "names the run's checkpoint and results files)", "refused before any work", "nothing written",
          "a plain name", before_torch=True),
    Fault("memory-device-nan", "`mapl memory --device-gib nan` (or ≤ 0; was: 'device memory nan' without the "
          "flag's name)", "mapl memory --profile micro --device-gib nan", 2,
          r"^error: --device-gib nan is invalid: must be a finite number > 0 \(GiB of device memory\)$",
          "error: --device-gib nan is invalid: must be a finite number > 0 (GiB of device memory)",
          "refused before the plan", "nothing written", "fix the value", slow=True),
    Fault("bad-flag", "an unknown flag (`--bogus`)", f"{T} --bogus {IO}", 2,
          r"^mapl train: error: unrecognized arguments: --bogus$",
          "usage: ... / mapl train: error: unrecognized arguments: --bogus",
          "argparse refuses it", "nothing written", "`--help` lists the flags", stderr="usage", before_torch=True),
    Fault("bad-choice", "a flag value outside its choices (`--method zip`)", f"{T} --method zip {IO}", 2,
          r"^mapl train: error: argument --method: invalid choice: 'zip' \(choose from .*mapl.*\)$",
          "usage: ... / mapl train: error: argument --method: invalid choice: 'zip' (choose from ...)",
          "argparse refuses it", "nothing written", "pick one of the listed values", stderr="usage", slow=True,
          before_torch=True),
    Fault("unknown-profile", "a profile params.yaml does not define (`--profile gpu`)",
          f"{T.replace('@run', '@run --profile gpu')} {IO}",
          2, r"^mapl train: error: argument --profile: invalid choice: 'gpu' \(choose from .*micro.*\)$",
          "usage: ... / mapl train: error: argument --profile: invalid choice: 'gpu' (choose from ...)",
          "argparse refuses it", "nothing written", "use a profile of params.yaml", stderr="usage", before_torch=True),
    Fault("params-missing", "params.yaml missing", f"{T} {IO}", 2,
          r"^error: .*/proj/params\.yaml not found: the profiles live in the project's params\.yaml \(run from a "
          r"full checkout\)$", "error: <project>/params.yaml not found: the profiles live in the project's "
          "params.yaml (run from a full checkout)", "refused at start", "nothing written",
          "run from a full checkout (`git checkout params.yaml`)", setup=params_yaml(None), before_torch=True),
    Fault("params-yaml-error", "params.yaml is not valid YAML", f"{T} {IO}", 2,
          r"^error: .*/proj/params\.yaml: invalid YAML at line \d+, column \d+: ",
          "error: <project>/params.yaml: invalid YAML at line L, column C: <problem>",
          "refused at start", "nothing written", "fix params.yaml at that line",
          setup=params_yaml("profile: micro\nprofiles:\n  micro: {model: micro\n"), before_torch=True),
    Fault("params-wrong-type", "params.yaml holds a string where a number belongs", f"{T} {IO}", 2,
          r"^error: profiles\.micro\.train\.steps='many' is invalid: must be an integer$",
          "error: profiles.micro.train.steps='many' is invalid: must be an integer",
          "refused at start", "nothing written", "fix params.yaml",
          setup=params_yaml(_set_in("profiles.micro.train.steps", "many")), slow=True, before_torch=True),
    Fault("params-unknown-key", "params.yaml has an unknown section", f"{T} {IO}", 2,
          r"^error: profiles\.micro: unknown key\(s\) \['trian'\]; allowed: \[",
          "error: profiles.micro: unknown key(s) ['trian']; allowed: [...]",
          "refused at start", "nothing written", "fix params.yaml",
          setup=params_yaml(_set_in("profiles.micro.trian", {"steps": 3})), slow=True, before_torch=True),
    Fault("lr-overflow", "a learning rate so large that the optimizer's float32 update overflows",
          f"{T} --set train.lr_adam=1e38 {IO}", 4, r"(overflow|learning rate)",
          "error: the optimizer update of step S overflows float32 (...): a learning rate is far too large. The last "
          "good checkpoint is kept; lower the learning rate and resume from it with --resume-with-changes",
          "stops at the step whose update overflows", "the last checkpoint", "lower the LR, `--resume-with-changes`",
          slow=True),
    # ---- data ------------------------------------------------------------------------------------------
    Fault("data-not-prepared", "the profile's data folder was never prepared",
          f"{T.replace('@run', '@run --set data_dir=nodata')} {IO}", 2,
          r"^error: nodata: no prepared dataset \(the folder is missing\); prepare it with `mapl data "
          r"--profile micro` \(or `dvc repro prepare`\)$",
          "error: <dir>: no prepared dataset (the folder is missing); prepare it with `mapl data "
          "--profile P` (or `dvc repro prepare`)", "refused before the model is built; nothing is downloaded or "
          "built by training", "nothing written", "`mapl data --profile P`"),
    Fault("shard-corrupt", "a byte flipped in train.bin", f"{T} {IO}", 2,
          rf"^error: data/train\.bin: sha256 mismatch: manifest\.json expects {HASH}, the file has {HASH} \(corrupt, "
          r"or from another preparation\); rebuild it with `mapl data --profile micro --rebuild`$",
          "error: <dir>/train.bin: sha256 mismatch: manifest.json expects <sha256>, the file has <sha256> (corrupt, "
          "or from another preparation); rebuild it with `mapl data --profile P --rebuild`",
          "refused with both hashes; nothing is rebuilt or deleted", "the shard as it is, the manifest",
          "`mapl data --profile P --rebuild`, then the same command", own_data=True,
          setup=flip_byte("data/train.bin"), recover=(REBUILD, f"{T} {IO}")),
    Fault("shard-missing", "train.bin deleted (no network needed: training never builds data)", f"{T} {IO}", 2,
          rf"^error: data/train\.bin is missing \(manifest\.json lists it with sha256 {HASH}\); rebuild the folder "
          r"with `mapl data --profile micro --rebuild`$",
          "error: <dir>/train.bin is missing (manifest.json lists it with sha256 <sha256>); rebuild the folder with "
          "`mapl data --profile P --rebuild`", "refused; the manifest is kept",
          "manifest.json and the other files", "`mapl data --profile P --rebuild`",
          own_data=True, setup=remove("data/train.bin")),
    Fault("shard-truncated", "a shard shorter than the manifest says", f"{T} {IO}", 2,
          r"^error: data/train\.bin has \d+ bytes, manifest\.json says \d+ \(truncated or replaced\); rebuild it with "
          r"`mapl data --profile micro --rebuild`$",
          "error: <dir>/train.bin has N bytes, manifest.json says M (truncated or replaced); rebuild it with "
          "`mapl data --profile P --rebuild`", "refused", "the shard as it is, the manifest",
          "`mapl data --profile P --rebuild`", own_data=True, setup=truncate("data/train.bin"), slow=True),
    Fault("manifest-corrupt", "manifest.json is not JSON", f"{T} {IO}", 2,
          r"^error: data/manifest\.json is not a valid manifest \(JSONDecodeError: .*\); rebuild the folder with "
          r"`mapl data --profile micro --rebuild`$",
          "error: <dir>/manifest.json is not a valid manifest (...); rebuild the folder with `mapl data "
          "--profile P --rebuild`", "refused", "every file as it is",
          "`mapl data --profile P --rebuild`", own_data=True, setup=write("data/manifest.json", "{"),
          slow=True),
    Fault("shard-truncated-mid-run", "a shard truncated in place while a run reads it (was SIGBUS)",
          f"{T} --steps 300 {TOO_LONG} {IO}", 2,
          r"^error: data/train\.bin: \d+ bytes missing at byte \d+: the file has 64 bytes, its manifest says \d+ "
          r"\(truncated or replaced while in use\); rebuild it with `mapl data --profile micro --rebuild`$",
          "error: <dir>/train.bin: N bytes missing at byte B: the file has 64 bytes, its manifest says M (truncated "
          "or replaced while in use); rebuild it with `mapl data --profile P --rebuild`",
          "the next read fails with one line", "the checkpoints written before", "`mapl data --profile P "
          "--rebuild`, then the same command", own_data=True, during=truncate_after(r"step 3/300 ", "data/train.bin"),
          changes=("data/train.bin",)),
    Fault("data-cli-corrupt-shard", "`mapl data` on a folder with a corrupt shard",
          "mapl data --out data --source text --paths {glob} --tokenizer byte", 2,
          rf"^mapl data: error: data/train\.bin: sha256 mismatch: manifest\.json expects {HASH}",
          "mapl data: error: data/train.bin: sha256 mismatch: manifest.json expects <sha256>, ...",
          "refused; nothing is rebuilt without --rebuild", "the shard as it is, the manifest",
          "the same command with `--rebuild`", own_data=True, setup=flip_byte("data/train.bin"), before_torch=True),
    Fault("data-cli-unknown-profile", "`mapl data --profile` with an unknown profile",
          "mapl data --profile gpu", 2,
          r"^mapl data: error: argument --profile: invalid choice: 'gpu' \(choose from .*'micro'.*\)$",
          "usage: ... / mapl data: error: argument --profile: invalid choice: 'gpu' (choose from ...)",
          "refused", "nothing written", "use a profile of params.yaml", stderr="usage", slow=True, before_torch=True),
    Fault("data-sigterm", "SIGTERM (or Ctrl-C) to `mapl data` while it encodes the corpus",
          "mapl data --out prepared --source text --paths 'big/*.txt' --tokenizer byte", 130,
          r"^mapl data: interrupted; run the same command again to resume$",
          "mapl data: interrupted; run the same command again to resume",
          "stops at once; the work folder (`<out>/.partial`) and the lock are removed or, for a streamed source, kept "
          "at the last whole chunk", "nothing of the preparation (an empty output folder)",
          "rerun the same command (a streamed source resumes from its last chunk)", stderr="any", setup=big_corpus,
          during=signal_when_exists("prepared/.partial/val.bin"),
          recover=("mapl data --out prepared --source text --paths 'big/*.txt' --tokenizer byte",),
          recovered=prepared("prepared"), slow=True),
    Fault("data-progress-nan", "`mapl data --progress-every nan` (or ≤ 0; was: taken silently)",
          "mapl data --out prepared --source text --paths {glob} --tokenizer byte --progress-every nan", 2,
          r"^mapl data: error: --progress-every nan is invalid: must be a finite number of seconds > 0$",
          "mapl data: error: --progress-every nan is invalid: must be a finite number of seconds > 0",
          "refused before anything is read", "nothing written", "fix the value", stderr="usage", before_torch=True),
    Fault("data-parquet-empty", "a 0-byte parquet file given to `mapl data` (was: a pyarrow traceback)",
          "mapl data --out prepared --source parquet --paths empty.parquet --tokenizer byte", 2,
          r"^mapl data: error: empty\.parquet is not a readable parquet file \(Parquet file size is 0 "
          r"bytes\): it is empty, truncated or damaged; replace it \(data\.paths\) and run the same command$",
          "mapl data: error: <file> is not a readable parquet file (Parquet file size is 0 bytes): it is "
          "empty, truncated or damaged; replace it (data.paths) and run the same command",
          "refused when the file is opened; no work folder is left", "every file", "replace the file",
          setup=write("empty.parquet", b""), before_torch=True),
    Fault("data-parquet-corrupt", "a corrupt parquet file (not parquet, or truncated)",
          "mapl data --out prepared --source parquet --paths bad.parquet --tokenizer byte", 2,
          r"^mapl data: error: bad\.parquet is not a readable parquet file \(Parquet magic bytes not found ",
          "mapl data: error: <file> is not a readable parquet file (Parquet magic bytes not found in "
          "footer. ...): it is empty, truncated or damaged; ...", "refused when the file is opened",
          "every file", "replace the file", setup=write("bad.parquet", b"PAR1" + bytes(range(200))), slow=True,
          before_torch=True),
    # ---- checkpoints and resume -----------------------------------------------------------------------
    Fault("checkpoint-truncated", "a truncated checkpoint", f"{T} --steps 2 {IO}", 2,
          r"^error: checkpoint r\.pt cannot be loaded safely \(truncated, foreign, or needs pickled objects\): "
          r".*\. Delete it or use --fresh$",
          "error: checkpoint <ckpt> cannot be loaded safely (truncated, foreign, or needs pickled objects): <why>. "
          "Delete it or use --fresh", "refused before training", "the checkpoint as it is, the results",
          "the same command with `--fresh` (starts over)", setup=both(seed("--steps 2"), truncate("r.pt")),
          recover=(f"{T} --steps 2 {IO} --fresh",)),
    Fault("checkpoint-pickled-object", "a checkpoint that needs unpickling code", f"{T} --steps 2 {IO}", 2,
          r"^error: checkpoint r\.pt cannot be loaded safely \(truncated, foreign, or needs pickled objects\): "
          r"UnpicklingError: .*\. Delete it or use --fresh$",
          "error: checkpoint <ckpt> cannot be loaded safely (...): UnpicklingError: ... Delete it or use --fresh",
          "refused (`weights_only=True`: no code runs)", "the file as it is", "`--fresh` or another `--ckpt`",
          setup=torch_save("r.pt", lambda: {"format": "mapl-checkpoint-v2", "obj": Evil()}), slow=True),
    Fault("checkpoint-foreign", "a checkpoint of another program", f"{T} --steps 2 {IO}", 2,
          r"^error: checkpoint r\.pt is not a mapl checkpoint; delete it or use --fresh$",
          "error: checkpoint <ckpt> is not a mapl checkpoint; delete it or use --fresh", "refused",
          "the file as it is", "`--fresh` or another `--ckpt`", setup=torch_save("r.pt", lambda: {"model": {}}),
          slow=True),
    Fault("checkpoint-missing-keys", "a checkpoint with missing keys", f"{T} --steps 2 {IO}", 2,
          r"^error: checkpoint r\.pt lacks \['meter', 'state\.train_curve'\]: it is damaged or was not written by "
          r"mapl; delete it or use --fresh$",
          "error: checkpoint <ckpt> lacks [...]: it is damaged or was not written by mapl; delete it or use --fresh",
          "refused", "the file as it is", "`--fresh`",
          setup=both(seed("--steps 2"), drop_keys("r.pt", "meter", "state.train_curve")), slow=True),
    Fault("checkpoint-other-config", "resume a checkpoint of another model/compressor/data/seed",
          f"{T} --method mapl --ratio 8 --steps 2 {IO}", 2,
          r"^error: checkpoint r\.pt was written by another config \(compressor\.ratio 4\.0 -> 8\.0.*\); only .* may "
          r"change on resume \(with --resume-with-changes\)\. Use another --ckpt path or --fresh$",
          "error: checkpoint <ckpt> was written by another config (<field> <old> -> <new>, ...); only <resumable "
          "fields> may change on resume (with --resume-with-changes). Use another --ckpt path or --fresh",
          "refused, naming the fields", "the checkpoint and results", "another `--ckpt`/`--out`, or `--fresh`",
          setup=seed("--method mapl --ratio 4 --steps 2")),
    Fault("resume-with-changes", "resume with a new LR or step budget, without saying so",
          f"{T} --steps 4 --set train.lr_muon=0.01 {IO}", 2,
          r"^error: checkpoint r\.pt was written with other settings \(train\.lr_muon 0\.02 -> 0\.01, train\.steps "
          r"2 -> 4\); to continue it with these, pass --resume-with-changes \(recorded in the results\), or use "
          r"--fresh$",
          "error: checkpoint <ckpt> was written with other settings (train.lr_muon 0.02 -> 0.01, ...); to continue it "
          "with these, pass --resume-with-changes (recorded in the results), or use --fresh",
          "refused", "the checkpoint and results", "the same command with `--resume-with-changes`",
          setup=seed("--steps 2"), recover=(f"{T} --steps 4 --set train.lr_muon=0.01 {IO} --resume-with-changes",),
          recovered=results_steps(4, resumed=True)),
    Fault("non-finite", "NaN/Inf during training (a far too large LR)",
          f"{T} --method mapl --ratio 4 --steps 6 --set train.lr_muon=1e30 --resume-with-changes {IO}", 4,
          r"^error: non-finite training loss nan at step \d+; first non-finite value: stage \d .*\. The last good "
          r"checkpoint is kept; lower the learning rate and resume from it with --resume-with-changes$",
          "error: non-finite training loss nan at step S; first non-finite value: stage K output (boundary K, ...). "
          "The last good checkpoint is kept; lower the learning rate and resume from it with --resume-with-changes",
          "stops at the first non-finite step, naming the step and the stage; the checkpoint is not updated",
          "the last checkpoint (byte for byte), the earlier results",
          "the same command with a lower LR and `--resume-with-changes`",
          setup=seed("--method mapl --ratio 4 --steps 2"),
          recover=(f"{T} --method mapl --ratio 4 --steps 6 --resume-with-changes {IO}",),
          recovered=results_steps(6, resumed=True)),
    Fault("non-finite-checkpoint-every-step", "NaN/Inf with a checkpoint after every step (the diverging update "
          "leaves huge but finite weights; the NaN shows one step later)",
          f"{T} --method mapl --ratio 4 --steps 6 --set train.lr_muon=1e30 --set train.checkpoint_every=1 "
          f"--resume-with-changes {IO}", 4,
          r"^error: non-finite training loss nan at step \d+; first non-finite value: stage \d .*\. The last good "
          r"checkpoint is kept; lower the learning rate and resume from it with --resume-with-changes$",
          "error: non-finite training loss nan at step N; first non-finite value: ... The last good checkpoint is "
          "kept; ...", "a checkpoint is confirmed only by a finite forward on its weights (the next step's loss); "
          "the unconfirmed one is dropped", "the last confirmed checkpoint, byte for byte",
          "lower the LR, rerun with `--resume-with-changes`", setup=seed("--method mapl --ratio 4 --steps 2"),
          after=checkpoint_step("r.pt", 2, 3, finite=True),
          recover=(f"{T} --method mapl --ratio 4 --steps 6 --set train.checkpoint_every=1 --resume-with-changes {IO}",),
          recovered=results_steps(6, resumed=True), slow=True),
    Fault("interrupt", "Ctrl-C (SIGINT) or SIGTERM mid-run", f"{T} --steps 12 {TOO_LONG} {IO}", 130,
          r"^interrupted: stopped after step \d+: checkpoint written; rerun the same command to resume$",
          "interrupted: stopped after step S: checkpoint written; rerun the same command to resume",
          "the step in flight completes, the checkpoint is written atomically",
          "the checkpoint of the last completed step", "rerun the same command (it resumes)",
          during=signal_after(r"step 3/12 "), after=checkpoint_step("r.pt", 3, 12), creates=("r.pt",),
          recover=(f"{T} --steps 12 {TOO_LONG} {IO}",), recovered=results_steps(12)),
    # ---- outputs -----------------------------------------------------------------------------------------
    Fault("out-equals-ckpt", "`--out x.pt --ckpt x.pt`", f"{T} --out r.pt --ckpt r.pt", 2,
          r"^error: --out r\.pt is also the checkpoint path: the results would overwrite the checkpoint; give them "
          r"different paths, e.g\. --out r\.json --ckpt r\.pt$",
          "error: --out <path> is also the checkpoint path: the results would overwrite the checkpoint; give them "
          "different paths, e.g. --out r.json --ckpt r.pt", "refused before any work", "the checkpoint",
          "give different paths", setup=seed("--steps 2"), before_torch=True),
    Fault("out-unwritable", "`--out` in a folder the user may not write", f"{T} --out ro/r.json --ckpt r.pt", 2,
          r"^error: cannot write ro/r\.json: Permission denied \(no permission to write there: choose a writable "
          r"folder\)$",
          "error: cannot write <path>: Permission denied (no permission to write there: choose a writable folder)",
          "refused before any work (was: found after the whole run)", "everything", "choose a writable folder",
          setup=read_only_folder("ro"), as_nobody=True, before_torch=True),
    Fault("ckpt-unwritable", "`--ckpt` in a folder the user may not write", f"{T} --out r.json --ckpt ro/r.pt", 2,
          r"^error: cannot write ro/r\.pt: Permission denied \(no permission to write there: choose a writable "
          r"folder\)$",
          "error: cannot write <ckpt>: Permission denied (no permission to write there: choose a writable folder)",
          "refused before any work", "everything", "choose a writable folder",
          setup=read_only_folder("ro"), as_nobody=True, slow=True, before_torch=True),
    # ---- the machine: a read-only checkout, no HOME, paths with spaces and letters beyond ASCII ---------------
    Fault("checkout-read-only-sweep", "`mapl sweep` in a checkout on a read-only filesystem (a review mount)",
          "mapl sweep --group main", 2,
          r"^error: cannot write .*/proj/dvc\.lock: Read-only file system " + RO_HINT,
          "error: cannot write <checkout>/dvc.lock: Read-only file system (this checkout is not writable: run in a "
          "writable copy, e.g. `mapl workspace repro --profile P --dir ../mapl-P`, or give output paths outside it)",
          "refused before DVC runs (dvc.lock, where DVC records each run, is probed first)", "everything",
          "`mapl workspace repro --dir <new folder>` copies the checkout and runs there",
          setup=checkout_copy, read_only="proj", before_torch=True),
    Fault("checkout-read-only-frozen-trunk", "`mapl frozen-trunk` in a read-only checkout (was: an OSError "
          "traceback)", "mapl frozen-trunk --profile micro", 2,
          r"^error: .*/proj/reports(/micro)?: Read-only file system " + RO_HINT,
          "error: <checkout>/reports/<profile>: Read-only file system (this checkout is not writable: ...)",
          "refused before any run (every OS error of a read-only filesystem, a full disk or a quota is a user error "
          "with a hint, exit 2, wherever it is met)", "everything", "run in a writable copy",
          setup=checkout_copy, read_only="proj", slow=True, before_torch=True),
    Fault("home-unset", "`HOME` is not set (a service account, `env -i`, a minimal container)",
          f"{T} --steps 2 {IO}", 0, (), "—", "trains as usual: nothing of the project reads HOME", "the run's outputs",
          "nothing to do", stderr="ranks", env={"HOME": None}, creates=("r.json", "r.pt")),
    Fault("paths-spaces-unicode", "output and data paths with spaces and letters beyond ASCII",
          f"{T} --steps 2 --out 'my runs/ä/r.json' --ckpt 'my runs/ä/r.pt'", 0, (), "—",
          "trains as usual; the paths are kept as given", "the run's outputs", "nothing to do", stderr="ranks",
          creates=("my runs/ä/r.json", "my runs/ä/r.pt"), slow=True),
    Fault("data-paths-spaces-unicode", "`mapl data` into a folder whose path has spaces and letters beyond ASCII",
          "mapl data --out 'données préparées/ä' --source text --paths {glob} --tokenizer byte", 0, (), "—",
          "prepares the data as usual", "the prepared folder", "nothing to do", stderr="any",
          creates=("données préparées/ä/*", "données préparées/ä/.*", "données préparées/ä/*/*"), before_torch=True),
    Fault("out-under-a-file", "an output path whose folder is a file", f"{T} --out afile/r.json --ckpt r.pt", 2,
          r"^error: cannot create the folder of afile/r\.json: .*\(a (file is where its folder should be|parent of "
          r"it is a file, not a folder)\)$",
          "error: cannot create the folder of <path>: File exists (a file is where its folder should be)",
          "refused before any work", "everything", "fix the path", setup=write("afile", "x"), slow=True, before_torch=True),
    Fault("outputs-locked", "a second run on the same `--out`/`--ckpt` while the first runs",
          f"{T} --steps 2 {IO}", 2,
          r"^error: r\.(json|pt) is in use by PID \d+ \(.*mapl(\.cli)? train.*\): wait for that run to finish, stop it, or "
          r"choose another output path$",
          "error: <path> is in use by PID <pid> (<its command line>): wait for that run to finish, stop it, or "
          "choose another output path", "the second run is refused at start", "the first run's files and locks",
          "wait, stop the other run, or choose other paths",
          setup=holder(f"{T} --steps 100000 {TOO_LONG} {IO}", r"step 2/100000 "), after=stop_holder),
    Fault("pipeline-outputs-locked", "a pipeline on the `--out` of a `mapl train` that is running (was: rank 0 "
          "refused, rank 1 ended with gloo's 'Connection closed by peer' and a traceback)",
          "mapl pipeline @run --steps 2 --out {dir}/r.json --ckpt {dir}/p.pt", 2,
          (r"^error: rank 0: .*r\.json is in use by PID \d+ \(.*mapl(\.cli)? train.*\): wait for that run to finish",
           r"^error: rank 1: .*r\.json is in use by PID \d+ \(.*mapl(\.cli)? train.*\): wait for that run to finish",
           r"^error: the pipeline failed \(exit codes per rank: \[2, 2\]\)$"),
          "error: rank R: <path> is in use by PID <pid> (<its command line>): wait for that run to finish, ... (the "
          "same line on every rank)", "every rank refuses before training: the ranks agree on their locks first",
          "the first run's files and locks", "wait, stop the other run, or choose other paths", stderr="ranks",
          setup=holder(f"{T} --steps 100000 {TOO_LONG} {IO}", r"step 2/100000 "), after=stop_holder, slow=True),
    Fault("results-other-config", "a run of another config on the `--out` of a finished run (was: replaced, exit 0)",
          f"{T} --steps 2 --seed 1 --out r.json --ckpt other.pt", 2,
          r"^error: --out r\.json holds the results of another config \(train\.seed 0 -> 1\): this run would replace "
          r"a finished run's numbers; choose another --out, or pass --replace-results to replace it$",
          "error: --out <path> holds the results of another config (train.seed 0 -> 1): this run would replace a "
          "finished run's numbers; choose another --out, or pass --replace-results to replace it",
          "refused before the first step (after the checkpoint's own checks); the same config, or a continuation "
          "with `--resume-with-changes` of resumable fields, may write there", "the results and checkpoints",
          "another `--out`, or the same command with `--replace-results`", setup=seed("--steps 2"),
          recover=(f"{T} --steps 2 --seed 1 --out r.json --ckpt other.pt --replace-results",)),
    Fault("results-not-results", "`--out` names a file that is no results JSON", f"{T} --steps 2 --out notes.json "
          "--ckpt r.pt", 2,
          r"^error: --out notes\.json exists and is not a mapl results JSON: this run would replace it; choose another "
          r"--out, or pass --replace-results to replace it$",
          "error: --out <path> exists and is not a mapl results JSON: this run would replace it; choose another --out, "
          "or pass --replace-results to replace it", "refused before the first step", "everything",
          "another `--out`", setup=write("notes.json", '{"my": "notes"}'), slow=True),
    Fault("pipeline-results-other-config", "the multi-process pipeline on the `--out` of a finished run of another "
          "config", "mapl pipeline @run --steps 2 --seed 1 --out {dir}/r.json --ckpt {dir}/other.pt", 2,
          r"^error: --out .*/r\.json holds the results of another config \(train\.seed 0 -> 1\): ",
          "error: --out <path> holds the results of another config (train.seed 0 -> 1): ...",
          "refused before any rank starts (ranks started by a launcher: rank 0 refuses and every rank exits 2 with "
          "its line)", "the results and checkpoints", "another `--out`, or `--replace-results`",
          setup=pipeline_run(f"{MP} --steps 2"), slow=True),
    Fault("disk-full", "a write fails (file-size limit `ulimit -f`; a full disk or quota names its own cause)",
          f"{T} --steps 4 --resume-with-changes {IO}", 2,
          r"^error: cannot write r\.pt: File too large \(the file-size limit is reached \(ulimit -f\) or the disk is "
          r"full\)$",
          "error: cannot write <path>: File too large (the file-size limit is reached (ulimit -f) or the disk is "
          "full)", "the run stops at the failed write",
          "the previous checkpoint and results, byte for byte; no temp file", "free space, rerun the same command",
          setup=seed("--steps 2"), file_size_limit=1 << 20, recover=(f"{T} --steps 4 --resume-with-changes {IO}",),
          recovered=results_steps(4, resumed=True)),
    # ---- the multi-process pipeline -----------------------------------------------------------------------
    Fault("pipeline-bad-config", "invalid setting for the multi-process pipeline", f"{MP} --set train.grad_clip=-1",
          2, r"^error: train\.grad_clip=-1\.0 is invalid: must be >= 0$",
          "error: train.grad_clip=-1.0 is invalid: must be >= 0", "refused before any rank starts",
          "nothing written", "fix the value"),
    Fault("pipeline-env-not-a-number", "a launcher variable that is not a number (`WORLD_SIZE=abc`; was: "
          "'invalid literal for int()' without the variable)", MP, 2,
          r"^error: environment variable WORLD_SIZE='abc' is invalid: must be an integer$",
          "error: environment variable WORLD_SIZE='abc' is invalid: must be an integer",
          "refused before the rendezvous", "nothing written", "fix the launcher's environment",
          env={"WORLD_SIZE": "abc", "RANK": "0"}, before_torch=True),
    Fault("pipeline-rank-beyond-world", "`RANK` at or above `WORLD_SIZE` (was: exit 3 with gloo's own text, read as "
          "a peer failure)", MP, 2,
          r"^error: environment variable RANK=2 is invalid: must be in \[0, WORLD_SIZE=2\) \(ranks are numbered "
          r"from 0\)$",
          "error: environment variable RANK=2 is invalid: must be in [0, WORLD_SIZE=2) (ranks are numbered from 0)",
          "refused before the rendezvous", "nothing written", "number the ranks 0 .. WORLD_SIZE - 1",
          env={"WORLD_SIZE": "2", "RANK": "2"}, before_torch=True),
    Fault("pipeline-rendezvous-env", "`MAPL_RENDEZVOUS_TIMEOUT=abc` (was: a message without the variable)", MP, 2,
          r"^error: environment variable MAPL_RENDEZVOUS_TIMEOUT='abc' is invalid: must be a number$",
          "error: environment variable MAPL_RENDEZVOUS_TIMEOUT='abc' is invalid: must be a number",
          "refused before any rank starts", "nothing written", "give seconds (or `--rendezvous-timeout`)",
          env={"MAPL_RENDEZVOUS_TIMEOUT": "abc"}, before_torch=True),
    Fault("pipeline-bad-timeout", "a communication timeout that is not a positive number of seconds (`--timeout 0`)",
          f"{MP} --timeout 0", 2, r"^error: train\.comm_timeout_s=0\.0 is invalid: must be > 0$",
          "error: train.comm_timeout_s=0.0 is invalid: must be > 0", "refused before any rank starts",
          "nothing written", "give seconds > 0 (`--timeout`, `train.comm_timeout_s`, env MAPL_PG_TIMEOUT)"),
    Fault("pipeline-ranks-differ-seed", "the ranks were started with different settings (`--seed 1` on rank 1 only: "
          "another command or params.yaml on one machine; was: trained silently, the results claiming rank 0's config)",
          f"{MP} --steps 2", 2,
          r"^error: rank 0: the ranks were started for different runs \(settings differ\): rank 1 differs from rank 0 "
          r"in train\.seed \(0 vs 1\)\. Start every rank with the same command, params\.yaml, prepared data and "
          r"training code$",
          "error: rank R: the ranks were started for different runs (settings differ): rank 1 differs from rank 0 in "
          "train.seed (0 vs 1). Start every rank with the same command, params.yaml, prepared data and training code",
          "right after the process group is up, every rank compares its resolved config, shared options, data and "
          "code fingerprints with every other; all refuse, before any data is opened or file written",
          "nothing written", "start every rank with the same command, params.yaml, data and code",
          setup=other_rank(f"{MP} --steps 2 --seed 1"),
          after=other_rank_refused(r"^error: rank 1: the ranks were started for different runs .*train\.seed \(0 vs 1\)"),
          slow=True),
    Fault("pipeline-ranks-differ-ratio", "a different `--ratio` on one rank (was: an IndexError traceback)",
          f"{MP} --method mapl --ratio 4 --steps 2", 2,
          r"^error: rank 0: the ranks were started for different runs \(settings differ\): rank 1 differs from rank 0 "
          r"in compressor\.ratio \(4\.0 vs 2\.0\)\. Start every rank",
          "error: rank R: the ranks were started for different runs (settings differ): rank 1 differs from rank 0 in "
          "compressor.ratio (4.0 vs 2.0). Start every rank ...", "every rank refuses before any work",
          "nothing written", "start every rank with the same settings",
          setup=other_rank(f"{MP} --method mapl --ratio 2 --steps 2"),
          after=other_rank_refused(r"^error: rank 1: .* compressor\.ratio \(4\.0 vs 2\.0\)"), slow=True),
    Fault("pipeline-ranks-differ-method", "a different `--method` or `--steps` on one rank (was: a wait until "
          "`--timeout`, reported as a dead peer)", f"{MP} --method mapl --ratio 4 --steps 2", 2,
          r"^error: rank 0: the ranks were started for different runs \(settings differ\): rank 1 differs from rank 0 "
          r"in .*compressor\.method \(\"mapl\" vs \"ssn\"\).*train\.steps \(2 vs 3\)",
          "error: rank R: the ranks were started for different runs (settings differ): rank 1 differs from rank 0 in "
          "compressor.method (\"mapl\" vs \"ssn\"), ..., train.steps (2 vs 3) ...", "every rank refuses before any work",
          "nothing written", "start every rank with the same settings",
          setup=other_rank(f"{MP} --method ssn --ratio 4 --steps 3"),
          after=other_rank_refused(r"^error: rank 1: .* compressor\.method"), slow=True),
    Fault("pipeline-ranks-differ-code", "one rank runs other training code (a changed file on one machine)",
          f"{MP} --steps 2", 2,
          r"^error: rank 0: the ranks were started for different runs \(training code differ\): rank 1 differs from "
          r"rank 0 in code \([0-9a-f]{16} vs [0-9a-f]{16}\)\. Start every rank",
          "error: rank R: the ranks were started for different runs (training code differ): rank 1 differs from rank 0 "
          "in code (<fingerprint> vs <fingerprint>). Start every rank ...",
          "every rank refuses before any work (the fingerprint of `mapl.core.fingerprint.TRAIN_SOURCES`)", "nothing written",
          "install the same code on every machine", setup=other_rank(f"{MP} --steps 2", code_edit="mapl/core/loop.py"),
          after=other_rank_refused(r"^error: rank 1: .*training code differ"), slow=True),
    Fault("pipeline-peer-dies", "a stage process dies mid-step",
          f"{MP} --method mapl --ratio 4 --set train.checkpoint_every=2 --timeout 10", 3,
          (r"^MAPL_FAULT: rank 1 exits", r"^error: rank 0 \(stage 0\): .* from stage 1 failed during step 3 .*: a "
           r"peer stage died or did not answer within the 10 s process-group timeout",
           r"^error: the pipeline failed \(exit codes per rank: \[3, 1\]\)$"),
          "error: rank R (stage S): <operation> from stage K failed during step N (...): a peer stage died or did not "
          "answer within the T s process-group timeout (...); error: the pipeline failed (exit codes per rank: [...])",
          "the other ranks fail at their next wait on it (at most `train.comm_timeout_s` = `--timeout` s: 60 by "
          "default, 600 in the paper profile; on NCCL the watchdog aborts them instead, see below)",
          "the per-rank checkpoints of the last checkpointed step", "rerun the same command (it resumes)",
          stderr="ranks", env={"MAPL_FAULT_KILL_RANK": "1", "MAPL_FAULT_KILL_STEP": "3"},
          creates=("r.rank?.pt", "r.rank1.pt.lock", "r.rank1.prev.pt.lock", "r.rank1.unconfirmed.pt.lock"),
          recover=(f"{MP} --method mapl --ratio 4 --set train.checkpoint_every=2",), recovered=results_steps(20),
          slow=True),
    Fault("pipeline-peer-hangs", "a stage process stops answering", f"{MP} --timeout 4", 3,
          (r"^MAPL_FAULT: rank 1 hangs", r"^error: rank 0 \(stage 0\): .* from stage 1 failed during step 2 .*: a peer "
           r"stage died or did not answer within the 4 s process-group timeout",
           r"^error: the pipeline failed \(exit codes per rank: \[3, 1\]\)$"),
          "error: rank R (stage S): ... did not answer within the T s process-group timeout (...)",
          "the waiting ranks give up after `train.comm_timeout_s` (`--timeout`) seconds",
          "the per-rank checkpoints written before",
          "rerun the same command (it resumes)", stderr="ranks",
          env={"MAPL_FAULT_KILL_RANK": "1", "MAPL_FAULT_KILL_STEP": "2", "MAPL_FAULT_MODE": "hang",
               "MAPL_FAULT_HANG_S": "8"},
          creates=("r.rank1.pt.lock", "r.rank1.prev.pt.lock", "r.rank1.unconfirmed.pt.lock"), slow=True),
    Fault("pipeline-rank-stopped", "a stage process is stopped (SIGSTOP) mid-run (was: the other ranks exited 3, "
          "the launcher waited forever)", f"{MP} --timeout 4 {TOO_LONG}", 3,
          (r"^error: rank 0 \(stage 0\): .* failed during .*: a peer stage died or did not answer within the 4 s "
           r"process-group timeout",
           r"^error: rank 1 was still running 34 s \(--timeout \+ 30 s\) after rank 0 ended \(exit 3\): stopped it",
           r"^error: the pipeline failed \(exit codes per rank: \[3, -9\]\)$"),
          "error: rank R (stage S): ... did not answer within the T s process-group timeout (...); error: rank K was "
          "still running T+30 s (--timeout + 30 s) after rank R ended (exit 3): stopped it (a stopped or hung "
          "process); error: the pipeline failed (...)",
          "the waiting ranks give up after `--timeout`; the launcher stops every rank still running 30 s later "
          "(SIGTERM, then SIGKILL) and returns", "the per-rank checkpoints written before",
          "rerun the same command (it resumes)", stderr="ranks", during=sigstop_rank_after(r"step 3/20 ", 1),
          after=stopped_ranks_are_gone,
          creates=("r.rank1.pt.lock", "r.rank1.prev.pt.lock", "r.rank1.unconfirmed.pt.lock"), slow=True),
    Fault("pipeline-port-held", "MASTER_PORT is held by another program (a rank started by hand or by a launcher; "
          "was: a wait without limit)", f"{MP} --rendezvous-timeout 5", 3,
          r"^error: rank 1: the process group did not form within 5 s \(--rendezvous-timeout; rendezvous at "
          r"127\.0\.0\.1:\d+, 2 ranks\): a rank was not started or failed before joining, or another program holds "
          r"that port; start every rank, or choose a free port$",
          "error: rank R: the process group did not form within T s (--rendezvous-timeout; rendezvous at HOST:PORT, "
          "N ranks): a rank was not started or failed before joining, or another program holds that port; start "
          "every rank, or choose a free port", "the rank gives up after `--rendezvous-timeout` seconds (default "
          "300; rank 0 itself fails at once: `process-group setup failed: ... EADDRINUSE`)", "nothing written",
          "free the port or choose another", setup=port_held(), slow=True),
    Fault("pipeline-rank-late", "a rank started by hand after the others gave up waiting for it (past "
          "`--rendezvous-timeout`)", f"{MP} --rendezvous-timeout 5", 3,
          r"^error: rank 0: the process group did not form within 5 s \(--rendezvous-timeout; rendezvous at "
          r"127\.0\.0\.1:\d+, 2 ranks\): a rank was not started or failed before joining",
          "error: rank R: the process group did not form within T s (--rendezvous-timeout; ...): a rank was not started "
          "or failed before joining, ...", "the waiting rank gives up after `--rendezvous-timeout` seconds (exit 3); the "
          "late rank then finds no one and gives up after its own (exit 3, within 60 s here)", "nothing written",
          "start every rank within the timeout (or raise it)", setup=lone_rank,
          after=late_rank(f"{MP} --rendezvous-timeout 5", 60), slow=True),
    Fault("pipeline-interrupt", "Ctrl-C on the multi-process pipeline", f"{MP} {TOO_LONG}", 130,
          (r"^interrupted: rank 0 \(stage 0\): stopped after step \d+: checkpoint written",
           r"^interrupted: rank 1 \(stage 1\): stopped after step \d+: checkpoint written",
           r"^interrupted: all 2 ranks stopped after the same step and wrote their checkpoints \(r\.rank\*\.pt\); "
           r"rerun the same command to resume$"),
          "interrupted: rank R (stage S): stopped after step N: checkpoint written ...; interrupted: all P ranks "
          "stopped after the same step and wrote their checkpoints (<run>.rank*.pt); rerun the same command to resume",
          "every rank finishes the same step and writes its checkpoint",
          "the per-rank checkpoints", "rerun the same command (it resumes)", stderr="ranks",
          during=signal_after(r"step 3/20 "), creates=("r.rank?.pt", "r.rank?.prev.pt"),
          recover=(f"{MP} {TOO_LONG}",), recovered=results_steps(20), slow=True),
    Fault("pipeline-launcher-killed", "the command that started the ranks is killed (SIGKILL)",
          f"{MP} --steps 40 {TOO_LONG}", -signal.SIGKILL,
          (r"^interrupted: rank 0 \(stage 0\): stopped after step \d+: checkpoint written",
           r"^interrupted: rank 1 \(stage 1\): stopped after step \d+: checkpoint written"),
          "interrupted: rank R (stage S): stopped after step N: checkpoint written ... (one line per rank)",
          "no orphans: each rank gets SIGTERM from the kernel (parent-death signal), finishes the step in flight, "
          "writes its checkpoint and exits 130", "the per-rank checkpoints", "rerun the same command (it resumes)",
          stderr="ranks", during=signal_after(r"step 3/40 ", signal.SIGKILL), creates=("r.rank?.pt", "r.rank?.prev.pt"),
          recover=(f"{MP} --steps 40 {TOO_LONG}",), recovered=results_steps(40), exit_text="137 (killed)", slow=True),
    Fault("pipeline-slow-data", "rank 0 takes longer than `--timeout` to open (verify) the data",
          f"{MP} --steps 2 --timeout 2", 0, (), "(stdout) rank 1: waiting for the other ranks to open the data ...",
          "the other ranks wait for it, saying so, without a timeout", "the run's results and checkpoints",
          "nothing to do", stderr="ranks", env={"MAPL_FAULT_DATA_DELAY_S": "8"}, after=stdout_has(
              r"rank 1: waiting for the other ranks to open the data"), creates=("r.json", "r.rank?.pt"), slow=True),
    Fault("pipeline-non-finite", "NaN/Inf in the multi-process pipeline",
          f"{MP} --method mapl --ratio 4 --set train.lr_muon=1e30", 4,
          (r"^error: rank 0 \(stage 0\): non-finite training loss nan at step \d+; first non-finite value: stage \d ",
           r"^error: rank 1 \(stage 1\): non-finite training loss nan at step \d+; first non-finite value: stage \d ",
           r"^error: the pipeline failed \(exit codes per rank: \[4, 4\]\)$"),
          "error: rank R (stage S): non-finite training loss nan at step N; first non-finite value: stage K output "
          "(boundary K, ...). The last good checkpoint is kept; ...", "every rank stops at the same step",
          "the last good per-rank checkpoints", "lower the LR, rerun with `--resume-with-changes`", stderr="ranks",
          slow=True),
    Fault("pipeline-non-finite-checkpoint-every-step", "NaN/Inf in the multi-process pipeline with a checkpoint "
          "after every step", f"{MP} --method mapl --ratio 4 --steps 6 --set train.lr_muon=1e30 --set "
          "train.checkpoint_every=1 --resume-with-changes", 4,
          (r"^error: rank 0 \(stage 0\): non-finite training loss nan at step 3; first non-finite value: stage \d ",
           r"^error: rank 1 \(stage 1\): non-finite training loss nan at step 3; first non-finite value: stage \d ",
           r"^error: the pipeline failed \(exit codes per rank: \[4, 4\]\)$"),
          "error: rank R (stage S): non-finite training loss nan at step N; ... The last good checkpoint is kept; ...",
          "every rank drops its unconfirmed checkpoint", "the last confirmed per-rank checkpoints, byte for byte",
          "lower the LR, rerun with `--resume-with-changes`", stderr="ranks",
          setup=pipeline_run(f"{MP} --method mapl --ratio 4 --steps 2"),
          after=checkpoint_step("r.rank1.pt", 2, 3, finite=True),
          recover=(f"{MP} --method mapl --ratio 4 --steps 6 --set train.checkpoint_every=1 --resume-with-changes",),
          recovered=results_steps(6, resumed=True), slow=True),
    Fault("pipeline-relative-paths", "relative `--out`/`--ckpt` for the self-launched pipeline",
          f"mapl pipeline @run --steps 2 --out {REL}/r.json --ckpt {REL}/r.pt", 0, (), "(progress lines)",
          "the ranks run in the caller's working folder", "results and per-rank checkpoints where the paths say",
          "—", stderr="ranks", after=outputs_in_the_working_folder, creates=(f"{REL}/*",), slow=True),
    # ---- the report --------------------------------------------------------------------------------------
    Fault("report-results-truncated", "a truncated results JSON among the runs the report reads (was: left out "
          "without a word: Table 1's MAPL 8x row lost a seed)", "mapl plan res", 2,
          r"^error: .*/res/main/b\.json is not valid JSON \(truncated\? .*\): the report would leave this run out of "
          r"every table; rerun that run \(`dvc repro train@<run>`\), or move the file out of the results "
          r"folder$",
          "error: <results>/<group>/<run>.json is not valid JSON (truncated? ...): the report would leave this run out of "
          "every table; rerun that run (`dvc repro train@<run>`), or move the file out of the results folder",
          "the report (`mapl.report.load_results`: the report notebook, the planner) refuses before any table",
          "every file", "rerun the run, or move the file away",
          setup=both(seed("--steps 2"), results_folder(lambda p: os.truncate(p, p.stat().st_size // 2))), before_torch=True),
    Fault("report-results-empty", "an empty (0-byte) results JSON", "mapl plan res", 2,
          r"^error: .*/res/main/b\.json is empty: the report would leave this run out of every table; ",
          "error: <results>/<group>/<run>.json is empty: the report would leave this run out of every table; ...",
          "refused before any table", "every file", "rerun the run, or move the file away",
          setup=both(seed("--steps 2"), results_folder(lambda p: os.truncate(p, 0))), slow=True, before_torch=True),
    Fault("report-results-nan", "a results JSON whose val_loss is NaN (was: an AttributeError traceback)",
          "mapl plan res", 2,
          r"^error: .*/res/main/b\.json: val_loss is nan, not a finite number: the file is damaged or was not "
          r"written by a finished run; ",
          "error: <results>/<group>/<run>.json: val_loss is nan, not a finite number: the file is damaged or was not "
          "written by a finished run; ...", "refused before any table", "every file",
          "rerun the run, or move the file away", setup=both(seed("--steps 2"), results_folder(_nan_val_loss)),
          before_torch=True),
    Fault("report-results-wrong-type", "a results JSON with a field of the wrong type (`\"steps\": \"many\"`; was: a "
          "TypeError traceback inside a table)", "mapl plan res", 2,
          r"^error: .*/res/main/b\.json: steps is 'many', not an integer: the file is damaged; ",
          "error: <results>/<group>/<run>.json: steps is 'many', not an integer: the file is damaged; ...",
          "refused before any table", "every file", "rerun the run, or move the file away",
          setup=both(seed("--steps 2"), results_folder(_steps_a_string)), before_torch=True),
    # ---- the cost model ----------------------------------------------------------------------------------
    Fault("costmodel-mfu-zero", "`mapl costmodel --mfu 0` (was: a ZeroDivisionError traceback)",
          "mapl costmodel --profile micro --mfu 0", 2,
          r"^error: --mfu 0 is invalid: must be in \(0, 1\] \(the fraction of the peak sustained while computing\)$",
          "error: --mfu 0 is invalid: must be in (0, 1] (the fraction of the peak sustained while computing)",
          "refused before the estimate", "nothing written", "fix the value"),
    Fault("costmodel-peak-zero", "`mapl costmodel --peak-tflops 0`", "mapl costmodel --profile micro "
          "--peak-tflops 0", 2, r"^error: --peak-tflops 0 is invalid: must be a finite number > 0$",
          "error: --peak-tflops 0 is invalid: must be a finite number > 0", "refused before the estimate",
          "nothing written", "fix the value", slow=True),
    Fault("costmodel-out-unwritable", "`mapl costmodel --out` where it cannot be written (was: a traceback "
          "after the estimate)", "mapl costmodel --profile micro --out afile/gpu-hours.md", 2,
          r"^error: cannot create the folder of afile/gpu-hours\.md: .*\(a (file is where its folder should be|parent "
          r"of it is a file, not a folder)\)$",
          "error: cannot create the folder of <path>: File exists (a file is where its folder should be)",
          "refused before the estimate (the output is written atomically)", "everything", "fix the path",
          setup=write("afile", "x"), slow=True),
    # ---- orchestration: sweep, workspace -----------------------------------------------------------------
    Fault("sweep-unknown-group", "a group params.yaml does not define", "mapl sweep --group nope", 2,
          r"^error: group='nope' is invalid: allowed \[.*'main'.*\]$",
          "error: group='nope' is invalid: allowed [...]", "refused before any run starts",
          "nothing written", "use a group of the profile", before_torch=True),
    Fault("sweep-jobs-negative", "`mapl sweep --jobs -2` (was: accepted; a pool of -2 processes failed with a "
          "traceback once a run was due)", "mapl sweep --group main --jobs -2", 2,
          r"^error: --jobs -2 is invalid: must be >= 0 \(0: the profile's launcher\.jobs\)$",
          "error: --jobs -2 is invalid: must be >= 0 (0: the profile's launcher.jobs)", "refused before any run",
          "nothing written", "fix the value", before_torch=True),
    Fault("sweep-unknown-profile", "`mapl sweep --estimate` on an unknown profile",
          "mapl sweep --profile nope --estimate", 2, r"^mapl sweep: error: argument --profile: invalid choice: 'nope'",
          "usage: ... / mapl sweep: error: argument --profile: invalid choice: 'nope' (choose from ...)",
          "argparse refuses it", "nothing written",
          "use a profile of params.yaml", stderr="usage", slow=True, before_torch=True),
    Fault("params-checked-before-dvc", "`dvc repro` with a bad value in params.yaml (`profiles.micro.train.steps: "
          "many`; was: DVC deleted the group's committed results, then a papermill traceback)",
          "mapl sweep --check --stamp params-valid.txt", 2,
          r"^error: profiles\.micro\.train\.steps='many' is invalid: must be an integer$",
          "error: profiles.micro.train.steps='many' is invalid: must be an integer",
          "DVC's first stage (`validate`: every profile and every run) fails; every other stage "
          "depends on its stamp, so DVC stops before it removes any output", "every output (only the stamp "
          "`reports/params-valid.txt` is gone)", "fix params.yaml, rerun `dvc repro`",
          setup=params_yaml(_set_in("profiles.micro.train.steps", "many")), before_torch=True),
    Fault("params-bad-run-spec", "a bad value in one run (`ratio: x`)",
          "mapl sweep --check --stamp params-valid.txt", 2,
          r"^error: profiles\.micro\.runs\.micro-P2-ssn-4x-s0: compressor\.ratio='x' is invalid: must be a (finite )?number",
          "error: profiles.micro.runs.micro-P2-ssn-4x-s0: compressor.ratio='x' is invalid: ...",
          "the validate stage names the run and the field", "every output", "fix params.yaml, rerun `dvc repro`",
          setup=params_yaml(_set_in("profiles.micro.runs.micro-P2-ssn-4x-s0.ratio", "x")), slow=True, before_torch=True),
    Fault("params-bad-group-declaration", "a run group declared with a role the report does not know "
          "(`groups.main.role: final`)",
          "mapl sweep --check --stamp params-valid.txt", 2,
          r"^error: groups\.main\.role='final' is invalid: allowed: 'reported', 'tuning', 'other-corpus', 'redraw'$",
          "error: groups.main.role='final' is invalid: allowed: 'reported', 'tuning', 'other-corpus', 'redraw'",
          "the validate stage names the declaration's field and what is allowed, before any profile is read",
          "every output", "fix params.yaml, rerun `dvc repro`",
          setup=params_yaml(_set_in("groups.main.role", "final")), before_torch=True),
    Fault("params-run-name-path", "a run name that is a path (`../main/x: {...}`; was: accepted, and the run then "
          "wrote another group's results and a checkpoint outside the checkout)",
          "mapl sweep --check --stamp params-valid.txt", 2,
          r"^error: profiles\.micro\.runs\.\.\./main/x: run_name='\.\./main/x' is invalid: allowed letters, "
          r"digits and \. _ \+ = - \(no path separator, no '\.\.': it names the run's checkpoint and results files\)$",
          "error: profiles.micro.runs.../main/x: run_name='../main/x' is invalid: allowed letters, digits and "
          ". _ + = - (no path separator, no '..': it names the run's checkpoint and results files)",
          "the validate stage refuses the name before DVC removes any output", "every output",
          "a plain name, rerun `dvc repro`",
          setup=params_yaml(_set_in("profiles.micro.runs", {"../main/x": {"group": "main", "method": "none"}})),
          slow=True, before_torch=True),
    Fault("params-run-listed-twice", "one run listed twice (was: YAML kept the second silently)",
          "mapl sweep --check --stamp params-valid.txt", 2,
          r"^error: .*/proj/params\.yaml: invalid YAML at line \d+, column 7: duplicate key 'micro-P2-none-s0'$",
          "error: <checkout>/params.yaml: invalid YAML at line N, column 7: duplicate key 'micro-P2-none-s0'",
          "refused wherever params.yaml is read (any mapping: a setting given twice too)", "every output",
          "remove the copy, rerun `dvc repro`",
          setup=params_yaml((PROJECT / "params.yaml").read_text().replace(
              "      micro-P2-none-s0: {group: main, method: none}\n",
              "      micro-P2-none-s0: {group: main, method: none}\n      micro-P2-none-s0: {group: seeds, method: none}\n",
              1)), slow=True, before_torch=True),
    Fault("notebook-missing", "`mapl notebook` (how dvc.yaml executes a notebook) on a notebook that does not exist",
          "mapl notebook nope.ipynb out/nope.ipynb", 2, r"^error: notebook nope\.ipynb does not exist$",
          "error: notebook nope.ipynb does not exist", "refused before a kernel starts", "nothing written",
          "name a notebook of notebooks/", before_torch=True),
    Fault("plan-results-a-file", "`mapl plan` on a file, not a results folder (was: 'does not exist')",
          "mapl plan afile", 2,
          r"^error: results folder afile is not a folder: give the folder of a profile's results, e\.g\. "
          r"reports/cpu/results$",
          "error: results folder afile is not a folder: give the folder of a profile's results, e.g. reports/cpu/results",
          "refused before any result is read", "every file", "give the folder", setup=write("afile", "x"),
          before_torch=True),
    Fault("plan-target-nan", "`mapl plan --target-pct nan` (or ≤ 0; was: a report of 'no run' for nan, of nothing "
          "reached for a negative target)", "mapl plan res --target-pct nan", 2,
          r"^error: --target-pct nan is invalid: must be a finite number > 0 \(percent above uncompressed's best "
          r"loss\)$",
          "error: --target-pct nan is invalid: must be a finite number > 0 (percent above uncompressed's best loss)",
          "refused before any result is read", "nothing written", "fix the value", before_torch=True),
    Fault("frozen-trunk-unknown-profile", "`mapl frozen-trunk --profile nope` (was: 'has no seeds: nothing to run', "
          "exit 0)", "mapl frozen-trunk --profile nope", 2,
          r"^mapl frozen-trunk: error: argument --profile: invalid choice: 'nope' \(choose from .*'micro'.*\)$",
          "usage: ... / mapl frozen-trunk: error: argument --profile: invalid choice: 'nope' (choose from ...)",
          "refused before anything is written", "nothing written", "use a profile of params.yaml", stderr="usage",
          before_torch=True),
    Fault("frozen-trunk-jobs-negative", "`mapl frozen-trunk --jobs -1` (was: read as the launcher's default, and the "
          "study started)", "mapl frozen-trunk --profile micro --jobs -1", 2,
          r"^error: --jobs -1 is invalid: must be >= 0 \(0: the profile's launcher\.jobs\)$",
          "error: --jobs -1 is invalid: must be >= 0 (0: the profile's launcher.jobs)", "refused before any run",
          "nothing written", "fix the value", slow=True, before_torch=True),
    Fault("rescore-unknown-group", "`mapl rescore --group nope` (a group the profile does not have)",
          "mapl rescore --profile micro --group nope", 2,
          r"^error: --group 'nope' is invalid: profile micro has groups main, seeds, .*$",
          "error: --group 'nope' is invalid: profile micro has groups main, seeds, ...", "refused before anything is read",
          "nothing written", "a group of the profile", slow=True),
    Fault("rescore-untrained-group", "`mapl rescore` on a group whose runs have no results here (not trained)",
          "mapl rescore --profile micro --group long", 2,
          r"^error: group long of profile micro: 2 run\(s\) have no results \(micro-P2-none-40steps-s0, \.\.\.\): train "
          r"it first \(mapl sweep --group long\)$",
          "error: group long of profile micro: 2 run(s) have no results (micro-P2-none-40steps-s0, ...): train it first "
          "(mapl sweep --group long)", "refused before any run is scored", "nothing written",
          "train the group, then rescore it", slow=True),
    Fault("rerun-no-tolerance", "`mapl rerun` where the results hold no redraw group of the profile: no measured "
          "cross-machine spread", "mapl rerun --profile micro --group long --seeds 0 --results .", 2,
          r"^error: --tolerance is required: \. has no results of a redraw group of profile micro to measure the "
          r"cross-machine spread from$",
          "error: --tolerance is required: <results> has no results of a redraw group of profile micro to measure the "
          "cross-machine spread from", "refused before any run", "nothing written",
          "give --tolerance POINTS (docs/protocol.md, a reviewer's rerun)", before_torch=True),
    Fault("workspace-dir-not-empty", "`mapl workspace repro --dir` on a folder that holds other files (was: they "
          "were overwritten, then `git init`, `git add -A`, `git commit` in it)",
          "mapl workspace repro --profile micro --dir mine", 2,
          r"^error: --dir .*/mine exists, is not empty and is no mapl workspace \(no \.git/mapl-workspace\): the copy "
          r"would overwrite its files and commit them; choose a new or empty folder$",
          "error: --dir <path> exists, is not empty and is no mapl workspace (no .git/mapl-workspace): the copy would "
          "overwrite its files and commit them; choose a new or empty folder",
          "refused before anything is copied (a workspace made before, marked `.git/mapl-workspace`, is refreshed "
          "and resumes)", "everything", "a new or empty folder", setup=write("mine/README.md", "my notes\n"), before_torch=True),
    Fault("workspace-dir-checkout", "`mapl workspace repro --dir` naming the checkout (or a folder above it; was: "
          "a SameFileError traceback)", "mapl workspace repro --profile micro --dir {project}", 2,
          r"^error: --dir .* is this checkout or a folder above it: the copy would overwrite the checkout; choose a new "
          r"folder outside it, e.g\. \.\./mapl-<profile>$",
          "error: --dir <path> is this checkout or a folder above it: the copy would overwrite the checkout; choose a "
          "new folder outside it, e.g. ../mapl-<profile>", "refused before anything is copied (a folder inside the "
          "checkout too)", "everything", "a new folder outside the checkout", slow=True, before_torch=True),
    Fault("workspace-sigterm", "SIGTERM to `mapl workspace smoke` (or verify, repro) while DVC runs in the copy (was: "
          "the temporary copy and `dvc repro` in it were left behind)", "mapl workspace smoke", 130,
          r"^interrupted: SIGTERM received: the commands in the copy were stopped; the temporary copy was removed$",
          "interrupted: SIGTERM received: the commands in the copy were stopped; the temporary copy was removed",
          "every process below it gets SIGTERM (training runs write their checkpoints), SIGKILL 30 s later; the "
          "temporary copy is removed (kept with `--keep`; a `--dir` workspace is kept and resumes)",
          "nothing new (no temporary copy)", "rerun the command", setup=lambda ctx: (ctx.dir / "tmp").mkdir(),
          env={"TMPDIR": "tmp"}, during=signal_tree_after(r"Running stage"), after=tree_gone, slow=True),
    Fault("workspace-dvc-train-sigint", "Ctrl-C to `mapl workspace repro --dir` while `dvc repro train@<run>` trains "
          "in it (mid-way, its first checkpoint written)",
          f"mapl workspace repro --profile micro --dir ws train@{WS_RUN}", 130,
          r"^interrupted: SIGINT received: the commands in the copy were stopped; the workspace .*ws is kept \(rerun "
          r"the same command to resume\)$",
          "interrupted: SIGINT received: the commands in the copy were stopped; the workspace <dir> is kept (rerun the "
          "same command to resume)",
          "DVC and the run get SIGTERM (the run writes its checkpoint and stops), SIGKILL 30 s later; no process is "
          "left", "the workspace with its checkpoints",
          "rerun the same command: DVC reruns the stage and the run resumes from its checkpoint",
          stderr="any", setup=lambda ctx: (ctx.dir / "tmp").mkdir(), env={"TMPDIR": "tmp"},
          during=signal_tree_when_exists(f"ws/{WS_CKPT}"), after=interrupted_mid_run, creates=("ws/*",),
          recover=(f"mapl workspace repro --profile micro --dir ws train@{WS_RUN}",), recovered=resumed_in_workspace,
          slow=True),
    Fault("workspace-unknown-stage", "`mapl workspace repro` naming a stage dvc.yaml does not have",
          "mapl workspace repro --profile micro train@nope", 2,
          r"^error: stage 'train@nope' is invalid: allowed the stages of dvc\.yaml \(e\.g\. train, train@<run>, "
          r"report\)$",
          "error: stage 'train@nope' is invalid: allowed the stages of dvc.yaml (e.g. train, train@<run>, report)",
          "refused before anything is copied", "nothing written",
          "name a stage of `dvc stage list` (a run's training stage is train@<run>)",
          before_torch=True),
    Fault("workspace-verify-nothing-committed", "`mapl workspace verify` on a profile with no committed report (was: "
          "exit 1, which reads as a bug)", "mapl workspace verify --profile micro", 2,
          r"^error: --profile 'micro': no committed report outputs under reports/micro/ to verify$",
          "error: --profile 'micro': no committed report outputs under reports/micro/ to verify",
          "refused before anything is copied", "nothing written", "verify a profile whose report is committed (the "
          "default's)", before_torch=True),
    Fault("workspace-unknown-profile", "`mapl workspace repro/verify` on an unknown profile",
          "mapl workspace repro --profile nope", 2,
          r"^mapl workspace repro: error: argument --profile: invalid choice: 'nope' \(choose from .*'micro'.*\)$",
          "usage: ... / mapl workspace repro: error: argument --profile: invalid choice: 'nope' (choose from ...)",
          "refused before anything is copied", "nothing written", "use a profile of params.yaml", stderr="usage",
          before_torch=True),
]


class Evil:
    """Anything that is not a tensor or a plain container needs unpickling code."""


def _params(f: Fault):
    marks = [pytest.mark.slow] if f.slow else []
    if f.slow or not f.before_torch:
        marks.append(pytest.mark.full)
    if f.bug:
        marks.append(pytest.mark.xfail(strict=True, raises=KnownBug, reason=f.reason))
    return pytest.param(f, id=f.name, marks=marks)


@contextlib.contextmanager
def _row_folder(f: Fault, tmp_path: Path):
    if not f.as_nobody:
        yield tmp_path
        return
    # the command drops root: its folder must be reachable (pytest's tmp_path is private to root)
    base = Path(tempfile.mkdtemp(prefix="mapl-fault-"))
    try:
        base.chmod(0o777)
        yield base
    finally:
        for p in base.rglob("*"):
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(base)


def _nobody_argv(argv: list[str]) -> list[str]:
    """``mapl <command> ...`` as the unprivileged user (the command's module imported first, as root, then
    seteuid)."""
    code = ("import importlib, os, sys\nfrom mapl.cli import COMMANDS, main\n"
            "importlib.import_module('mapl.cli.' + COMMANDS[sys.argv[1]][0])\n"
            "if os.geteuid() == 0:\n    os.seteuid(%d)\nsys.exit(main(sys.argv[1:]))" % NOBODY)
    return [argv[0], "-c", code, *argv[len(MAPL):]]


def test_the_table_names_are_unique_and_every_row_is_documented():
    assert len({f.name for f in FAULTS}) == len(FAULTS)
    for f in FAULTS:
        assert f.bug and f.reason or not f.bug and all((f.shows, f.happens, f.kept, f.fix, f.line or f.code == 0)), \
            f.name


def test_the_checks_catch_what_they_must(tmp_path):
    """The harness itself: a lost, overwritten or new file, a temp file, a traceback, a second line."""
    (tmp_path / "keep").write_text("a")
    (tmp_path / "gone").write_text("b")
    before = snapshot(tmp_path)
    (tmp_path / "keep").write_text("changed")
    (tmp_path / "gone").unlink()
    (tmp_path / "r.json.123-ab.tmp").write_text("")
    (tmp_path / "new").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / ".verified-host.json").write_text("{}")      # the data folder's bookkeeping: fine
    ctx = Ctx(tmp_path, tmp_path, "", frozenset(), tmp_path)
    check_files(ctx, before)
    assert sorted(m for _, m in ctx.failures) == ["gone was lost", "keep was overwritten", "temp file left: "
                                                  "r.json.123-ab.tmp", "unexpected new file: new"]
    for err, mode in [("Traceback (most recent call last):\nerror: x\n", "one"), ("error: x\nerror: y\n", "one"),
                      ("error: y\n", "one"), ("error: x\n", "usage"), ("error: x\nwarning: y\n", "ranks")]:
        ctx = Ctx(tmp_path, tmp_path, "", frozenset(), tmp_path)
        check_stderr(ctx, err, mode, r"^error: x$")
        assert ctx.failures, (err, mode)
    ctx = Ctx(tmp_path, tmp_path, "", frozenset({"code"}), tmp_path)
    ctx.expect("code", False, "exit 1")
    with pytest.raises(KnownBug):
        ctx.verdict()
    ctx.expect("files", False, "lost")
    with pytest.raises(AssertionError) as e:
        ctx.verdict()
    assert not isinstance(e.value, KnownBug)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault-seeds")


@pytest.mark.process
@pytest.mark.parametrize("f", [_params(f) for f in FAULTS])
def test_fault(f: Fault, tmp_path, tiny_corpus, seeds):
    with _row_folder(f, tmp_path) as folder:
        ctx = Ctx(folder, tiny_corpus, str(tiny_corpus.parent / "doc*.txt"), frozenset(f.bug), seeds)
        try:
            _run_row(f, ctx)
        finally:
            for p in ctx.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    ctx.verdict()


def _run_row(f: Fault, ctx: Ctx) -> None:
    if f.own_data:
        shutil.copytree(ctx.data, ctx.dir / "data", ignore=shutil.ignore_patterns(".*"))
        ctx.data = Path("data")                     # relative: messages name data/train.bin
    if f.setup:
        f.setup(ctx)
    before = snapshot(ctx.dir)
    argv = ctx.argv(f.cmd)
    if f.as_nobody:
        argv = _nobody_argv(argv)
    if f.read_only:
        why = _read_only_mount_reason()
        if why:
            pytest.skip(why)
        argv = _read_only_argv(ctx.dir / f.read_only, argv)
    limit = f.file_size_limit
    p = subprocess.Popen(argv, cwd=ctx.dir, env=ctx.env({**f.env, **ctx.env_extra}), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
                         if limit else None)
    try:
        if f.during:
            f.during(p, ctx)
        out, err = p.communicate(timeout=f.timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    out = ctx.stdout + out
    ctx.expect("code", p.returncode == f.code, f"exit code {p.returncode}, documented {f.code}:\n{err[-3000:]}")
    check_stderr(ctx, err, f.stderr, f.line)
    check_files(ctx, before, f.changes, f.creates)
    if f.after:
        f.after(ctx, out, err)
    r = None
    for cmd in f.recover:
        r = ctx.run(cmd, timeout=f.timeout)
        ctx.expect("recover", r.returncode == 0, f"recovery `{cmd}` exited {r.returncode}:\n{r.stderr[-3000:]}")
    if r is not None:
        left = [rel for rel in snapshot(ctx.dir) if rel.endswith((".tmp", ".lock"))
                and not _matches(rel, (*DATA_BOOKKEEPING, "*/dvc.lock", "*/.dvc/tmp/rwlock.lock"))]   # DVC's own
        ctx.expect("recover", not left, f"left after the recovery: {left}")
        if f.recovered:
            f.recovered(ctx, r.stdout, r.stderr)          # what the last recovery command printed


# ---- docs/failure-modes.md ----------------------------------------------------------------------------------
def failure_modes_md() -> str:
    """The Markdown table of every row that is no known bug (what the tests prove)."""
    from mapl.base.cli import EXIT_CODES

    def cell(s: str) -> str:
        return s.replace("|", "\\|")
    lines = ["# Failure modes", "",
             "Generated from `tests/test_faults.py` (`python tests/test_faults.py > docs/failure-modes.md`): every row is "
             "a test that runs the command on the micro profile and checks the exit code, the message (no "
             "traceback), that no file was lost or overwritten and no temp file is left, and the recovery where "
             "one is given.", "",
             "| fault | command | what happens | what the user sees (stderr) | exit | kept on disk | how to go on |",
             "|---|---|---|---|---|---|---|"]
    for f in FAULTS:
        if f.bug:
            continue
        command = f"`mapl {f.cmd.split()[1]}`"
        lines.append(f"| {cell(f.fault)} | {command} | {cell(f.happens)} | `` {cell(f.shows)} `` | "
                     f"{f.exit_text or f.code} | {cell(f.kept)} | {cell(f.fix)} |")
    lines += ["", "Exit codes (`mapl.base.cli`, every `mapl` command):", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {cell(text)} |" for code, text in sorted(EXIT_CODES.items())]
    lines += ["", NCCL_TIMEOUTS]
    return "\n".join(lines) + "\n"


# the rows above run on gloo (CPU); what differs on NCCL is not testable here, so it is said once
NCCL_TIMEOUTS = (
    "**Timeouts on GPUs (NCCL).** The rows for a dead or hung peer run on gloo, where a wait past "
    "`train.comm_timeout_s` raises and the rank exits 3 with the line above. On NCCL a wait does not block the "
    "host (it orders streams), so nothing raises in Python: PyTorch's NCCL watchdog finds the operation past the "
    "same timeout (each process group is made with it) and, by default (`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`), "
    "takes the process down (SIGABRT, exit 134 / -6) after logging `Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=..., OpType=..., Timeout(ms)=...)`; the launcher then reports that rank's code "
    "instead of 3. The checkpoints are the same as with exit 3 (only confirmed ones replace the last good one): "
    "rerun the same command to resume. `TORCH_NCCL_BLOCKING_WAIT=1` makes waits raise (exit 3 with the "
    "message) at the cost of a host sync per wait. The paper profile sets 600 s (NCCL's own default), above a "
    "1B stage's checkpoint write; the fused RVQ search is compiled before the first timed wait.")


def test_failure_modes_md_is_the_table():
    path = PROJECT / "docs" / "failure-modes.md"
    assert path.read_text() == failure_modes_md(), "regenerate: python tests/test_faults.py > docs/failure-modes.md"


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT))
    sys.stdout.write(failure_modes_md())
