"""Training runs: one run as DVC's ``train@<run>`` stage trains it, many side by side, and what they will cost.

How a profile's runs start is ``profiles.<p>.launcher`` (params.yaml says more); DVC decides which runs are stale.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import os
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ..base.io import OutputError, atomic_write_json, atomic_write_text, check_writable, read_json_object
from ..core.config import PROJECT_ROOT, ConfigError, RunConfig, build, check_fields, config_hash, load_params, setting
from ..core.runtime.faults import exit_with_parent
from .groups import group_names, group_specs, profile_runs, results_dir, spec_config
from .progress import (LAUNCH_OVERHEAD_S, UNPREPARED_EVAL_TOKENS, StepProgress, emit, estimate_core_seconds,
                       estimate_group, eval_split_guessed, hms, named_warnings)

__all__ = ["LAUNCHERS", "LauncherConfig", "launcher_config", "checkpoint_path", "prepare_data", "train_one",
           "train_pool", "worker_init", "sweep", "estimate_text"]

LAUNCHERS = ("pool", "accelerate", "torchrun")


@dataclass(frozen=True)
class LauncherConfig:
    """How the runs of a profile start (``profiles.<p>.launcher``)."""
    kind: str = setting("pool", choices=LAUNCHERS)
    jobs: int = setting(2, min=1)                   # pool: runs side by side (mapl sweep, train_pool)
    gpus: int = setting(0, min=0)                   # accelerate/torchrun: GPUs of this machine (0: CPU, gloo)
    memory_gib: float = setting(0.0, min=0)         # per GPU (whole host when gpus = 0); 0 = no check


def launcher_config(profile: str, params: dict | None = None) -> LauncherConfig:
    params = params or load_params()
    where = f"profiles.{profile}.launcher"
    launcher = build(LauncherConfig, (params["profiles"][profile] or {}).get("launcher") or {}, where)
    check_fields(launcher, where)
    return launcher


def checkpoint_path(profile: str, name: str) -> Path:
    """Where run ``name`` of ``profile`` keeps its checkpoint (git-ignored)."""
    return PROJECT_ROOT / "checkpoints" / profile / f"{name}.pt"


def prepare_data(cfgs: list[RunConfig]) -> None:
    """Each dataset a pool of runs reads, prepared once here (idempotent), never by a pipeline's stage processes or
    by one `mapl train` (its data is the prepare stage's: training never builds data)."""
    from .. import data as mdata
    from ..core.engine import resolve_data_dir
    for data_dir, cfg in {resolve_data_dir(c): c for c in cfgs}.items():
        mdata.prepare(cfg.data, data_dir, profile=cfg.profile)


# ---- one run ---------------------------------------------------------------------------------------
def train_one(profile: str, cfg: RunConfig, spec: dict, out: Path, ckpt: Path, every_s: float = 5.0,
              by_launcher: bool = True, log=print, **run_flags) -> dict | None:
    """Train ``cfg`` here, or with ``by_launcher`` as the profile's launcher starts it; the results (None if launched)."""
    launcher = launcher_config(profile)
    if launcher.kind == "pool" or not by_launcher:
        from ..core.run import run
        progress = StepProgress(cfg.name(), every_s) if every_s else None
        with named_warnings(cfg.name(), progress):
            return run(cfg, out=out, ckpt=ckpt, progress=False, log=log, on_step=progress, **run_flags)
    _launch(profile, cfg, spec, out, ckpt, launcher)
    return None


def _memory_refusal(cfg: RunConfig, out: Path, launcher: LauncherConfig) -> str | None:
    """The memory plan, written beside the results; the reason a run is not launched, or None."""
    from ..core.memory import GiB, format_plan, memory_plan
    plan = memory_plan(cfg, device="cuda" if launcher.gpus else "cpu")
    need = plan.peak.total if launcher.gpus else sum(s.total for s in plan.stages)
    limit = launcher.memory_gib * GiB * 0.9            # the same 10 % reserve as mapl.core.memory.check_plan
    where = "per GPU" if launcher.gpus else f"for {cfg.stages} processes on this host"
    verdict = (f"needs {need / GiB:.1f} GiB {where}; {launcher.memory_gib:g} GiB less 10 % allows "
               f"{limit / GiB:.1f}: {'launched' if need <= limit else 'NOT launched (memory plan only)'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_suffix(".memory.md"), format_plan(plan) + f"\n\n{verdict}\n")
    atomic_write_json(out.with_suffix(".memory.json"), {**plan.to_dict(), "verdict": verdict})
    return None if need <= limit else verdict


def _launch(profile: str, cfg: RunConfig, spec: dict, out: Path, ckpt: Path, launcher: LauncherConfig) -> None:
    from .launch import launch             # the one place ranks are started
    if launcher.gpus and cfg.stages > launcher.gpus:
        raise ConfigError(f"run {cfg.name()} needs {cfg.stages} GPUs (one per stage) but launcher.gpus={launcher.gpus}")
    if launcher.memory_gib:
        refusal = _memory_refusal(cfg, out, launcher)
        if refusal:
            raise ConfigError(f"run {cfg.name()} {refusal}: see {out.with_suffix('.memory.md')}")
    sets = [f"{k}={v}" for k, v in spec.items() if k not in ("name", "group")] + [f"run_name={cfg.name()}"]
    args = ["--profile", profile, *[a for s in sets for a in ("--set", s)], "--out", str(out), "--ckpt", str(ckpt),
            "--no-progress"]
    emit(f"{cfg.name()}: {launcher.kind} launch of {cfg.stages} processes" + (" on GPUs" if launcher.gpus else ""))
    res = launch(args, cfg.stages, launcher=launcher.kind, stream=True)
    if res.returncode != 0:
        raise RuntimeError(f"run {cfg.name()} failed (exit {res.returncode}; its ranks' output is above)")


# ---- runs outside DVC's stages (the frozen-trunk study's trunks, rescoring) ------------------------------
def _pool_worker(args) -> dict:
    """One run in a pool worker; its status goes back to the pool (or, the parent gone, the worker leaves quietly)."""
    cfg, out, ckpt, every_s = args
    parent = os.getppid()
    from ..core.loop import Interrupted
    from ..core.run import run
    progress = StepProgress(cfg.name(), every_s) if every_s else None
    try:
        with named_warnings(cfg.name(), progress):
            res = run(cfg, out=out, ckpt=ckpt, progress=False, log=lambda *a, **k: None, on_step=progress)
        status = {"run": cfg.name(), "val_loss": res["val_loss"]}
    except Interrupted as e:             # a stop signal: the checkpoint is written
        status = {"run": cfg.name(), "interrupted": str(e)}
    except Exception as e:               # noqa: BLE001 -- one failed run must not take the others down; it is reported
        status = {"run": cfg.name(), "error": f"{type(e).__name__}: {e}"}
    if os.getppid() != parent:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if "interrupted" in status else 0)
    return status


def worker_init() -> None:
    """A pool worker stops with its parent however it dies (a watchdog: PR_SET_PDEATHSIG follows the parent *thread*)."""
    exit_with_parent(mechanism="watchdog", poll_s=0.5)


def train_pool(profile: str, specs: list[dict], out_dir: Path, jobs: int = 0, every_s: float = 0.0,
               params: dict | None = None, ckpt_dir: Path | None = None) -> list[dict]:
    """Train each spec into ``out_dir``, ``jobs`` side by side, resuming from checkpoints (the profile's, or those in
    ``ckpt_dir``); raises naming any failed run."""
    params = params or load_params()
    todo = [spec_config(profile, s, params).validate() for s in specs]
    status = []
    prepare_data(todo)
    workers = min(jobs or launcher_config(profile, params).jobs, len(todo))
    if todo:
        ckpt = (lambda name: Path(ckpt_dir) / f"{name}.pt") if ckpt_dir else (lambda name: checkpoint_path(profile, name))
        tasks = [(c, Path(out_dir) / f"{c.name()}.json", ckpt(c.name()), every_s) for c in todo]
        with mp.get_context("spawn").Pool(workers, initializer=worker_init, maxtasksperchild=1) as pool:
            for st in pool.imap_unordered(_pool_worker, tasks):
                status.append(st)
                if "interrupted" in st:     # nothing new starts; leaving the block stops the pool (SIGTERM)
                    from ..core.loop import Interrupted
                    raise Interrupted(f"{st['run']} stopped by a signal ({st['interrupted']}); rerun to resume")
    failed = [s for s in status if "error" in s]
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: " + "; ".join(f"{s['run']}: {s['error']}" for s in failed))
    return status


# ---- many runs through DVC -------------------------------------------------------------------------
def sweep(profile: str, names: list[str], jobs: int = 0, root: Path = PROJECT_ROOT) -> list[str]:
    """``dvc repro --single-item train@<name>`` per name, ``jobs`` (or, on GPUs, P free GPUs) at a time; the failed names."""
    params = load_params(Path(root) / "params.yaml")
    launcher, runs = launcher_config(profile, params), profile_runs(profile, params)
    need = {n: spec_config(profile, {"name": n, **runs[n]}, params).stages if launcher.gpus else 1 for n in names}
    too_big = [n for n, k in need.items() if launcher.gpus and k > launcher.gpus]
    if too_big:
        raise ConfigError(f"run {too_big[0]} needs {need[too_big[0]]} GPUs (one per stage) but "
                          f"profiles.{profile}.launcher.gpus={launcher.gpus}")
    slots = launcher.gpus or jobs or (launcher.jobs if launcher.kind == "pool" else 1)
    check_writable(Path(root) / "dvc.lock")      # a read-only checkout: one line here, not DVC's own error
    check_disk_space([spec_config(profile, {"name": n, **runs[n]}, params) for n in names],
                     Path(root) / "checkpoints" / profile)
    dvc = [sys.executable, "-m", "dvc", "repro"]
    if subprocess.run([*dvc, "prepare"], cwd=root).returncode:
        raise RuntimeError("`dvc repro prepare` failed (its output is above): the runs need their data")
    free, failed, cond, threads = list(range(slots)), [], threading.Condition(), []

    def one(name: str, taken: list[int]) -> None:
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, taken))} if launcher.gpus else {})}
        code = subprocess.run([*dvc, "--single-item", f"train@{name}"], cwd=root, env=env).returncode
        with cond:
            failed.extend([name] if code else [])
            free.extend(taken)
            cond.notify_all()

    for name in names:
        with cond:
            cond.wait_for(lambda: len(free) >= need[name])
            taken, free[:] = sorted(free)[:need[name]], sorted(free)[need[name]:]
        threads.append(threading.Thread(target=one, args=(name, taken), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    return failed


def check_disk_space(cfgs: list[RunConfig], folder: Path) -> None:
    """Refuse a group whose checkpoints would not fit the free space of ``folder``'s disk, before its first run (a
    full disk would stop it at some later checkpoint). Each run keeps its checkpoint and the one before it; a third
    copy exists while one is written. A checkpoint holds the weights, the optimizer state and the compressors'
    state (the memory plan's fp32 terms)."""
    from ..core.memory import memory_plan      # torch: stages are built on the meta device
    sizes = [sum(s.params + s.optimizer + s.compressor for s in memory_plan(c, device="cpu").stages) for c in cfgs]
    if not sizes:
        return
    need = 2 * sum(sizes) + max(sizes)
    where = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        raise OutputError(f"cannot write the checkpoints of {len(cfgs)} run(s) under {folder}: no space left on the "
                          f"device ({free / 1e6:,.0f} MB free, about {need / 1e6:,.0f} MB needed); free space and rerun")


# ---- what it will cost -----------------------------------------------------------------------------
def _measured_text(cfgs: list[RunConfig], out_dir: Path) -> str:
    """What the committed results of these runs (same config hash) took on the machine that trained them."""
    walls = []
    for cfg in cfgs:
        path = Path(out_dir) / f"{cfg.name()}.json"
        res = (read_json_object(path) if path.is_file() else None) or {}
        if (res.get("provenance") or {}).get("config_hash") == config_hash(cfg.validate()) and \
                isinstance(res.get("train_wall_s"), (int, float)):
            walls.append(float(res["train_wall_s"]))
    if not walls:
        return ""
    return f"measured {len(walls)} of {len(cfgs)} runs: {hms(statistics.median(walls))} per run (median train_wall_s)"


def estimate_text(profile: str, params: dict | None = None) -> str:
    """Runs per group and their wall time on this machine, trained as ``mapl sweep`` trains them."""
    params = params or load_params()
    launcher = launcher_config(profile, params)
    workers = launcher.jobs if launcher.kind == "pool" else 1
    how = f"{workers} side by side" if launcher.kind == "pool" else "one launch at a time"
    profile_runs(profile, params)
    lines, total, guessed_in_all = [f"profile {profile}: launcher {launcher.kind}"], 0.0, 0
    names = [g for g in group_names(profile, params) if group_specs(profile, g, params)]
    width = max(map(len, names), default=0)
    for group in names:
        cfgs = [spec_config(profile, s, params) for s in group_specs(profile, group, params)]
        extra = 0.0 if launcher.kind == "pool" else LAUNCH_OVERHEAD_S
        wall = estimate_group([estimate_core_seconds(c) + extra for c in cfgs], workers)
        total += wall
        measured = _measured_text(cfgs, results_dir(profile, group))
        guessed = sum(map(eval_split_guessed, cfgs))
        guessed_in_all += guessed
        unprepared = (f"; {guessed} run(s) read a validation split not prepared here: each evaluation priced "
                      f"at {UNPREPARED_EVAL_TOKENS:,} tokens" if guessed else "")
        lines.append(f"  {group:<{width}} {len(cfgs):>3} run(s)  about {hms(wall):>7} ({how}{unprepared})"
                     + (f"; {measured}" if measured else ""))
    lines.append(f"  total about {hms(total)} (fitted to this machine's committed runs; `threads: 1` per run"
                 + (f"; {guessed_in_all} run(s) priced without their validation split's size, above)" if guessed_in_all else ")"))
    return "\n".join(lines)
