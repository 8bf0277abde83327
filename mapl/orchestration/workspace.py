"""The DVC pipeline on any profile in a copy of this checkout, so nothing here changes (`mapl workspace`).

docs/reproducing.md describes the copy, ``--dir`` workspaces, signals and exit codes.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..base.cli import EXIT_INTERRUPTED, EXIT_STEP_FAILED, EXIT_USER_ERROR, SUPERVISED_ENV
from ..core.config import PROJECT_ROOT

__all__ = ["SMOKE_TARGETS", "MARKER", "Stopped", "WorkspaceError", "stage_names", "tool_env", "make_copy", "check_dir",
           "dvc", "repro", "smoke", "compare_outputs", "verify", "run_command"]

SMOKE_TARGETS = ("report", "plan")      # and what they need; plan-paper is profile-independent
STOP_GRACE_S = 30.0          # after SIGTERM, how long the processes in a copy may take to stop (then SIGKILL)
MARKER = Path(".git") / "mapl-workspace"     # in a copy: says the folder is a workspace made by this module
_GIT_ID = {"GIT_AUTHOR_NAME": "mapl workspace", "GIT_AUTHOR_EMAIL": "workspace@mapl.invalid",
           "GIT_COMMITTER_NAME": "mapl workspace", "GIT_COMMITTER_EMAIL": "workspace@mapl.invalid"}


class WorkspaceError(RuntimeError):
    """A step in the copy failed or its outputs differ; the message says which (exit 5)."""


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM: the commands in the copy were stopped (and the temporary copy removed)."""


def _stop_tree(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to ``proc`` and every process below it (checkpoints written), SIGKILL to any left ``grace_s`` later."""
    import psutil
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    proc.wait()


def _run(cmd: list, cwd: Path, env: dict, capture: bool) -> str:
    """Run ``cmd`` in a session of its own: a Ctrl-C reaches only this process, which stops the tree below it."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=pipe, stderr=pipe, start_new_session=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        _stop_tree(proc)
        raise
    if proc.returncode != 0:
        tail = ((out or "") + (err or ""))[-4000:] if capture else ""
        raise WorkspaceError(f"`{' '.join(map(str, cmd))}` failed in {cwd} (exit {proc.returncode})\n{tail}".rstrip())
    return (out or "") + (err or "")


def tool_env(root: Path = PROJECT_ROOT, checkout: Path | None = None) -> dict:
    """DVC's environment in the copy ``checkout``: this venv first on PATH, the copy first on PYTHONPATH (the venv's
    ``mapl`` would import ``root``'s code), offline, raw downloads shared with ``root``."""
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "DVC_NO_ANALYTICS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           SUPERVISED_ENV: "1", **_GIT_ID}      # a stop of the copy is reported once, by this command
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(checkout).resolve()), os.environ.get("PYTHONPATH"))
                                            if p)
    env.setdefault("MAPL_CACHE_DIR", str(Path(root) / "data" / "raw"))
    return env


def make_copy(dest: Path, profile: str, root: Path = PROJECT_ROOT, env: dict | None = None) -> Path:
    """Copy the files git would commit into ``dest``, set ``profile:`` and commit them in a new git repository."""
    dest = Path(dest)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode()
    for rel in sorted({p for p in listed.split("\0") if p and (Path(root) / p).is_file()}):
        target = dest / rel
        if rel == "dvc.lock" and target.exists():      # a lasting workspace keeps what its own runs recorded
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(root) / rel, target)
    params = dest / "params.yaml"
    text, n = re.subn(r"(?m)^profile:\s*\S+", f"profile: {profile}", params.read_text(), count=1)
    text, m = re.subn(r"(?m)^runs:\s*\*\S+", f"runs: *runs_{profile}", text, count=1)
    if n != 1 or m != 1:
        raise ValueError(f"{params}: no top-level `profile:` and `runs: *runs_<profile>` lines to set to {profile!r}")
    params.write_text(text)
    env = env or tool_env(root, dest)
    _run(["git", "init", "-q"], dest, env, capture=True)
    (dest / MARKER).write_text(f"{Path(root).resolve()}\n")     # inside .git: not part of the copy's tree
    for cmd in (["git", "add", "-A"], ["git", "commit", "-q", "--allow-empty", "-m", f"workspace: {profile}"]):
        _run(cmd, dest, env, capture=True)
    return dest


def check_dir(into: Path, root: Path = PROJECT_ROOT) -> None:
    """A ``--dir`` workspace must be new, empty, or one made before (refreshed); else a one-line ``ValueError``."""
    into, root = Path(into).resolve(), Path(root).resolve()
    if into == root or root.is_relative_to(into):
        raise ValueError(f"--dir {into} is this checkout or a folder above it: the copy would overwrite the checkout; "
                         "choose a new folder outside it, e.g. ../mapl-<profile>")
    if into.is_relative_to(root):
        raise ValueError(f"--dir {into} is inside this checkout: the next copy would copy the workspace into "
                         "itself; choose a new folder outside it, e.g. ../mapl-<profile>")
    if into.exists() and not into.is_dir():
        raise ValueError(f"--dir {into} is a file, not a folder; choose a new or empty folder")
    if into.is_dir() and any(into.iterdir()) and not (into / MARKER).is_file():
        raise ValueError(f"--dir {into} exists, is not empty and is no mapl workspace (no {MARKER}): the copy would "
                         "overwrite its files and commit them; choose a new or empty folder")


def dvc(args: list[str], cwd: Path, env: dict, capture: bool = False) -> str:
    """``dvc <args>`` with this venv's DVC; output streams to the terminal unless ``capture``."""
    return _run([str(Path(sys.executable).parent / "dvc"), *args], cwd, env, capture)


def _new_copy(profile: str, root: Path, into: Path | None = None) -> tuple[Path, dict]:
    """A fresh temporary copy, or ``into`` (refreshed: DVC's state and checkpoints stay, a run resumes)."""
    dest = Path(into) if into else Path(tempfile.mkdtemp(prefix=f"mapl-{profile}-"))
    env = tool_env(root, dest)
    try:
        make_copy(dest, profile, root, env)
    except BaseException:                # a failed or interrupted copy: a temporary one is not left behind
        if not into:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest, env


def _done(dest: Path, keep: bool) -> None:
    if keep:
        print(f"workspace kept: {dest}", flush=True)
    else:
        shutil.rmtree(dest, ignore_errors=True)


def repro(profile: str, root: Path = PROJECT_ROOT, copy_back: bool = False, keep: bool = False,
          capture: bool = False, into: Path | None = None, targets: list[str] | None = None) -> str:
    """``dvc repro [targets]`` on ``profile`` in a fresh copy (or the kept workspace ``into``); ``copy_back``:
    replace reports/<profile>/ here by the copy's. Returns the captured output or ''."""
    targets = list(targets or [])
    unknown = sorted(set(targets) - set(stage_names(root, profile)))
    if unknown:
        raise ValueError(f"stage {unknown[0]!r} is invalid: allowed the stages of dvc.yaml (e.g. train, train@<run>, "
                         "report)")
    if copy_back and profile == _default_profile(root):       # a typo would delete the committed reports
        raise ValueError(f"--profile {profile!r} is this checkout's default: run `dvc repro` here instead of "
                         "copying its reports back")
    if into is not None:
        check_dir(into, root)
    dest, env = _new_copy(profile, root, into)
    keep = keep or into is not None
    try:
        log = dvc(["repro", *targets], dest, env, capture)
        if copy_back:
            src, target = dest / "reports" / profile, Path(root) / "reports" / profile
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(src, target)
            print(f"copied reports/{profile}/ from the workspace", flush=True)
    finally:
        _done(dest, keep)
    return log


def stage_names(root: Path = PROJECT_ROOT, profile: str = "") -> list[str]:
    """dvc.yaml's stages as ``dvc repro`` names them on ``profile`` (default: this checkout's), ``train@<run>`` too."""
    import yaml

    from ..core.config import load_params
    params, names = load_params(Path(root) / "params.yaml"), []
    runs = (params["profiles"].get(profile or params["profile"]) or {}).get("runs") or {}
    for name, stage in yaml.safe_load((Path(root) / "dvc.yaml").read_text())["stages"].items():
        names.append(name)
        if stage.get("foreach") == "${runs}":
            names += [f"{name}@{run}" for run in runs]
    return names


def _default_profile(root: Path) -> str:
    from ..core.config import load_params
    return load_params(Path(root) / "params.yaml")["profile"]


def _git_status(root: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True,
                          text=True, check=True).stdout


def smoke(root: Path = PROJECT_ROOT, keep: bool = False, capture: bool = False) -> tuple[Path | None, str]:
    """:data:`SMOKE_TARGETS` on ``micro`` in a copy; a second repro must do nothing, this checkout's git status not
    change. Returns (the copy's path when ``keep``, the first repro's output when ``capture``)."""
    t0, before = time.monotonic(), _git_status(root)
    dest, env = _new_copy("micro", root)
    try:
        log = dvc(["repro", *SMOKE_TARGETS], dest, env, capture)
        second = dvc(["repro", *SMOKE_TARGETS], dest, env, capture=True)
        if "Running stage" in second or "up to date" not in second:
            raise WorkspaceError(f"a second `dvc repro` on micro was not a no-op:\n{second[-3000:]}")
        after = _git_status(root)
        if after != before:
            raise WorkspaceError(f"the smoke run changed this checkout's git status:\n{after}")
    except BaseException:
        _done(dest, keep)
        raise
    print("smoke: prepare, train@*, report and plan on micro, second repro a no-op, checkout untouched "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    _done(dest, keep)
    return (dest if keep else None), log


def compare_outputs(copy: Path, profile: str, env: dict) -> list[str]:
    """The report outputs of ``profile`` (tables, figures, metrics.json) that differ from what the copy committed."""
    paths = [f"reports/{profile}/{sub}" for sub in ("tables", "figures", "metrics.json")]
    status = _run(["git", "status", "--porcelain", "--untracked-files=all", "--", *paths], copy, env, capture=True)
    words = {"D": "missing after re-execution", "??": "new after re-execution"}
    problems = [f"{words.get(line[:2].strip(), 'differs')}: {line[3:]}" for line in status.splitlines()]
    diff = _run(["git", "diff", "-U0", "--diff-filter=M", "--", *paths], copy, env, capture=True).splitlines()
    return problems + ["    " + line for line in diff[:30] if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def verify(profile: str = "", root: Path = PROJECT_ROOT, keep: bool = False, capture: bool = False) -> list[str]:
    """Re-execute the report of ``profile`` (default: params.yaml's) in a copy; raises on a difference."""
    profile = profile or _default_profile(root)
    if not (Path(root) / "reports" / profile / "tables").is_dir():
        raise ValueError(f"--profile {profile!r}: no committed report outputs under reports/{profile}/ to verify")
    dest, env = _new_copy(profile, root)
    try:
        dvc(["repro", "--force", "--single-item", "report"], dest, env, capture)
        problems = compare_outputs(dest, profile, env)
    finally:
        _done(dest, keep)
    if problems:
        raise WorkspaceError(f"the re-executed report of {profile} differs from the committed one:\n" + "\n".join(problems))
    print(f"verify: tables, figures and metrics of reports/{profile}/ re-executed identically", flush=True)
    return problems


def run_command(command: str, profile: str = "", copy_back: bool = False, keep: bool = False,
                into: Path | None = None, targets: list[str] | None = None) -> int:
    """``mapl workspace <command>``'s exit code: 2 a user error, 5 a failed step or a difference, 130 a signal."""
    old = _stop_on_signals()
    try:
        if command == "smoke":
            smoke(keep=keep)
        elif command == "repro":
            repro(profile, copy_back=copy_back, keep=keep, into=into, targets=targets)
        else:
            verify(profile, keep=keep)
    except ValueError as e:                          # a user error (profile, params.yaml): one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except WorkspaceError as e:                      # a step in the copy failed or outputs differ: exit 5
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STEP_FAILED
    except KeyboardInterrupt as e:                   # SIGINT/SIGTERM: the tree in the copy is stopped
        kept = f"; the workspace {into} is kept (rerun the same command to resume)" if into \
            else "; the temporary copy was removed" if not keep else ""
        print(f"interrupted: {e or 'stopped'}: the commands in the copy were stopped{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0


def _stop_on_signals() -> dict:
    """SIGTERM and SIGINT raise :class:`Stopped`, so the finally blocks clean up; returns the previous handlers."""
    def stop(signum, frame):
        raise Stopped(f"{signal.Signals(signum).name} received")
    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
