"""Run groups from params.yaml: every run trained once, reused when it can be, with live progress.

A profile lists the runs of every declared group (``profiles.<p>.groups.<name>``; their specs, defaults
and seeds: :mod:`mapl.orchestration.groups`) and how runs start (``profiles.<p>.launcher``):

* ``{kind: pool, jobs: 2}`` (micro, cpu): each run is one process of the single-process pipeline,
  ``jobs`` side by side with one thread each (two 1-thread runs use 2 cores better than one 2-thread run);
* ``{kind: accelerate, gpus: 8, memory_gib: 80}`` (paper; ``gpus: 0`` for paper-smoke on CPU, gloo):
  each run is one ``accelerate launch`` of the multi-process pipeline with P processes, one GPU per
  stage; runs queue one after another, side by side only when enough GPUs are free for both. With
  ``memory_gib`` a run whose memory plan (mapl.core.memory) does not fit is not launched; its plan is
  written beside the results instead. ``torchrun`` works the same way.

A spec is a dict of overrides for :func:`mapl.core.config.load_run_config` (``method``, ``ratio``,
``projector``, ``anchor``, ``train.seed``, ``model.d_model``, ...) plus an optional ``name`` (default:
:func:`run_name`, e.g. ``tiny-P4-mapl-8x-3000steps-s1``). Results go to ``<out_dir>/<run>.json``,
checkpoints to ``checkpoints/<profile>/<run>.pt``; :func:`mapl.orchestration.reuse.decide` says which runs are
current, which restore or resume from a checkpoint, and which train.

Progress goes to stderr (fd 2, so it reaches the terminal through papermill's kernel too): every few
seconds of work ``run 3 of 11 tiny-P4-ssn-8x-s0 step 120/300 loss 4.512 ETA 0:42``, and after each run
the group's count and ETA.

    mapl sweep --profile cpu --group main                    # train one group (reports/cpu/results/main)
    mapl sweep --profile cpu --group blocks --seeds 1        # only its seed-1 runs (a group's seeds split across
                                                             # machines; `mapl reuse adopt` joins them)
    mapl sweep --profile cpu --estimate                      # runs per group, estimated wall time
    mapl sweep --check                                       # every profile and run of params.yaml valid? (DVC's first
                                                             # stage; mapl.orchestration.validate)
    mapl sweep --profile cpu --group tune --jobs 1
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.config import PROJECT_ROOT, ConfigError, RunConfig, build, check_fields, config_hash, load_params, setting
from ..base.cli import EXIT_INTERRUPTED, EXIT_OK
from ..base.io import OutputLock
from ..core.fingerprint import code_fingerprint
from ..core.runtime.faults import exit_with_parent
from . import reuse
from .groups import (check_names, group_lock, group_names, group_specs, hold_group_lock, results_dir, run_name,
                     runs_of_seeds, spec_config)
from .progress import (LAUNCH_OVERHEAD_S, UNPREPARED_EVAL_TOKENS, GroupClock, StepProgress, emit, estimate_core_seconds,
                       estimate_group, eval_split_guessed, hms, named_warnings)

# group_names ... spec_config (mapl.orchestration.groups) stay importable from here: notebooks/train.ipynb (a dep of
# every train stage) and the frozen-trunk study (whose text is part of its runs' currency) read them as sweep's
__all__ = ["LAUNCHERS", "LauncherConfig", "Job", "group_names", "group_specs", "runs_of_seeds", "launcher_config",
           "run_name", "measured_text", "failure_summary", "spec_config", "plan_group", "estimate_text", "results_dir",
           "check_names", "checkpoint_path", "launch_args", "prepare_data", "status_table", "stage_table", "run_many",
           "group_lock_path", "hold_group", "worker_init"]

LAUNCHERS = ("pool", "accelerate", "torchrun")
@dataclass(frozen=True)
class LauncherConfig:
    """How the runs of a profile start (``profiles.<p>.launcher``)."""
    kind: str = setting("pool", choices=LAUNCHERS)
    jobs: int = setting(2, min=1)                   # pool: runs side by side
    gpus: int = setting(0, min=0)                   # accelerate/torchrun: GPUs of this machine (0: CPU, gloo)
    memory_gib: float = setting(0.0, min=0)         # per GPU (whole host when gpus = 0); 0 = no check


@dataclass
class Job:
    """One run of a group: where it writes and what :func:`mapl.orchestration.reuse.decide` said about it."""
    k: int
    n: int
    cfg: RunConfig
    spec: dict
    out: Path
    ckpt: Path
    action: str
    start_step: int = 0

    @property
    def name(self) -> str:
        return self.cfg.name()


def launcher_config(profile: str, params: dict | None = None) -> LauncherConfig:
    params = params or load_params()
    where = f"profiles.{profile}.launcher"
    launcher = build(LauncherConfig, (params["profiles"][profile] or {}).get("launcher") or {}, where)
    check_fields(launcher, where)
    return launcher


def checkpoint_path(profile: str, name: str) -> Path:
    """Where run ``name`` of ``profile`` keeps its checkpoint (git-ignored; shared by every group)."""
    return PROJECT_ROOT / "checkpoints" / profile / f"{name}.pt"


def plan_group(profile: str, specs: list[dict], out_dir: Path, params: dict | None = None,
               fingerprint: str | None = None, log=lambda msg: None) -> list[Job]:
    """A :class:`Job` per spec, with its reuse decision (stale results/checkpoints are deleted here)."""
    params = params or load_params()
    fingerprint = fingerprint or code_fingerprint()
    jobs = []
    for k, spec in enumerate(specs, 1):
        # validated (projector and anchor resolved): the config a run records its hash of; every
        # spec is checked before any work starts
        cfg = spec_config(profile, spec, params).validate()
        out = Path(out_dir) / f"{cfg.name()}.json"
        ckpt = checkpoint_path(profile, cfg.name())
        action, step = reuse.decide(cfg, out, ckpt, fingerprint, log)
        jobs.append(Job(k, len(specs), cfg, spec, out, ckpt, action, step))
    return jobs


def estimate_text(profile: str, params: dict | None = None) -> str:
    """Runs per group and their wall time on this machine (:func:`mapl.orchestration.progress.estimate_core_seconds`),
    printed before any work starts (dvc.yaml's prepare stage). Profiles launched on GPUs are estimated in
    GPU-hours by the planning layer instead (``mapl sweep --estimate``: mapl/orchestration/sweep.py)."""
    params = params or load_params()
    launcher = launcher_config(profile, params)
    workers = launcher.jobs if launcher.kind == "pool" else 1
    how = f"{workers} side by side" if launcher.kind == "pool" else "one launch at a time"
    lines, total, guessed_in_all = [f"profile {profile}: launcher {launcher.kind}"], 0.0, 0
    trained: set[tuple[str, str]] = set()       # (name, config hash) of the runs of earlier groups
    names = group_names(profile, params)
    width = max(map(len, names), default=0)
    for group in names:
        cfgs = [spec_config(profile, s, params) for s in group_specs(profile, group, params)]
        keys = [(c.name(), config_hash(c.validate())) for c in cfgs]
        # a run an earlier group trains is copied from it (mapl.orchestration.reuse: "copied"), in no time
        own = [c for c, k in zip(cfgs, keys) if k not in trained]
        trained.update(keys)
        extra = 0.0 if launcher.kind == "pool" else LAUNCH_OVERHEAD_S
        wall = estimate_group([estimate_core_seconds(c) + extra for c in own], workers)
        total += wall
        measured = measured_text(cfgs, results_dir(profile, group))
        shared = f", {len(cfgs) - len(own)} copied from earlier groups" if len(own) < len(cfgs) else ""
        guessed = sum(map(eval_split_guessed, own))
        guessed_in_all += guessed
        unprepared = (f"; {guessed} run(s) read a validation split not prepared here: each evaluation priced "
                      f"at {UNPREPARED_EVAL_TOKENS:,} tokens" if guessed else "")
        lines.append(f"  {group:<{width}} {len(cfgs):>3} run(s)  about {hms(wall):>7} ({how}{shared}{unprepared})"
                     + (f"; {measured}" if measured else ""))
    lines.append(f"  total about {hms(total)} (fitted to this machine's committed runs; `threads: 1` per run"
                 + (f"; {guessed_in_all} run(s) priced without their validation split's size, above)" if guessed_in_all else ")"))
    return "\n".join(lines)


def measured_text(cfgs: list[RunConfig], out_dir: Path) -> str:
    """What the committed results of these runs (same config hash) measured: "measured 24 of 24 runs:
    23:50 per run (median train_wall_s)"; empty when none has results. The estimate is a model calibrated on one
    machine; this is what the machine that trained them took (with whatever else ran beside them)."""
    walls = []
    for cfg in cfgs:
        try:
            res = json.loads((Path(out_dir) / f"{cfg.name()}.json").read_text())
        except (OSError, ValueError):
            continue
        same_config = isinstance(res, dict) and (res.get("provenance") or {}).get("config_hash") == config_hash(cfg.validate())
        if same_config and isinstance(res.get("train_wall_s"), (int, float)):
            walls.append(float(res["train_wall_s"]))
    if not walls:
        return ""
    return f"measured {len(walls)} of {len(cfgs)} runs: {hms(statistics.median(walls))} per run (median train_wall_s)"


# ---- executing ------------------------------------------------------------------------------------
def _pool_worker(args) -> dict:
    """One run in a pool worker; its status goes back to the sweep. When the sweep's process is gone (it was
    stopped with the rest of the tree, e.g. `mapl workspace` stopping DVC, papermill and the kernel at once),
    nobody reads the status: the worker leaves quietly, where returning would print multiprocessing's
    BrokenPipeError traceback. The checkpoint (or the results JSON) is written either way."""
    parent = os.getppid()
    status = _train_job(*args)
    if os.getppid() != parent:           # re-parented: the sweep died while this run stopped or finished
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED if "interrupted" in status else EXIT_OK)
    return status


def _train_job(job: Job, every_s: float, fingerprint: str) -> dict:
    import torch
    torch.set_num_threads(job.cfg.train.threads or 1)
    from ..core.run import run
    reuse.mark_code(job.ckpt, fingerprint)
    t0 = time.time()
    from ..core.loop import Interrupted
    progress = StepProgress(job.k, job.n, job.name, every_s) if every_s else None
    try:
        with named_warnings(job.name, progress):
            res = run(job.cfg, out=job.out, ckpt=job.ckpt, progress=False, log=lambda *a, **k: None,
                      on_step=progress)
    except Interrupted as e:         # a stop signal: the checkpoint is written; the group stops (_run_pool)
        return {"k": job.k, "run": job.name, "interrupted": str(e)}
    except Exception as e:           # noqa: BLE001 -- one failed run must not take the group down; it is reported
        return {"k": job.k, "run": job.name, "error": f"{type(e).__name__}: {e}"}
    reuse.stamp_results(job.out, fingerprint)
    return {"k": job.k, "run": job.name, "action": job.action, "from_step": job.start_step,
            "val_loss": res["val_loss"], "wall_s": round(time.time() - t0, 1)}


def worker_init() -> None:
    """Each pool worker stops with its sweep: SIGTERM when the process that started it dies, however it dies. A
    sweep's parent can be killed outright (SIGKILL, the OOM killer, papermill shutting down the kernel that runs
    ``dvc repro``'s notebook); without this its workers would train on as orphans. SIGTERM is the graceful stop:
    the step in flight completes and the checkpoint is written.

    A watchdog thread polls the parent's pid (``exit_with_parent(mechanism="watchdog")``), not the kernel's
    parent-death signal (``PR_SET_PDEATHSIG``, which the stage processes use): that signal fires when the parent
    *thread* that spawned the process ends, and a pool's replacement workers (``maxtasksperchild=1``: one per run
    after the first) are spawned by its worker-handler thread, which ends at every pool shutdown. Such a worker
    then got SIGTERM while it could still hold the result queue's lock, and the sweep hung at exit in
    ``Pool.terminate`` (seen after a group's last run)."""
    exit_with_parent(mechanism="watchdog", poll_s=0.5)


def _run_pool(jobs: list[Job], workers: int, every_s: float, fingerprint: str, clock: GroupClock | None):
    ctx = mp.get_context("spawn")    # fresh interpreters: no torch thread pools inherited from the parent
    by_k = {j.k: j for j in jobs}
    with ctx.Pool(min(workers, len(jobs)), initializer=worker_init, maxtasksperchild=1) as pool:
        for st in pool.imap_unordered(_pool_worker, [(j, every_s, fingerprint) for j in jobs]):
            if "interrupted" in st:
                # Was: the worker's KeyboardInterrupt escaped the pool, which lost the task and started the
                # next runs. Now nothing new starts; leaving the block terminates the pool (SIGTERM), and a
                # run still in flight stops after its step with its checkpoint written, as on Ctrl-C.
                yield st
                return
            if clock:
                clock.finished(by_k[st["k"]], "failed" if "error" in st else f"val {st['val_loss']:.4f}")
            yield st


def launch_args(job: Job, profile: str) -> list[str]:
    """The command line of one run for ``mapl pipeline`` (the spec as ``--set`` values)."""
    sets = [f"{k}={v}" for k, v in job.spec.items() if k != "name"] + [f"run_name={job.name}"]
    return ["--profile", profile, *[a for s in sets for a in ("--set", s)], "--out", str(job.out),
            "--ckpt", str(job.ckpt), "--no-progress"]


def _memory_refusal(job: Job, launcher: LauncherConfig) -> str | None:
    """The memory plan, written beside the results; the reason a run is not launched, or None."""
    from ..core.memory import GiB, format_plan, memory_plan
    from ..base.io import atomic_write_json
    plan = memory_plan(job.cfg, device="cuda" if launcher.gpus else "cpu")
    need = plan.peak.total if launcher.gpus else sum(s.total for s in plan.stages)
    limit = launcher.memory_gib * GiB * 0.9            # the same 10 % reserve as mapl.core.memory.check_plan
    where = "per GPU" if launcher.gpus else f"for {job.cfg.stages} processes on this host"
    verdict = (f"needs {need / GiB:.1f} GiB {where}; {launcher.memory_gib:g} GiB less 10 % allows "
               f"{limit / GiB:.1f}: {'launched' if need <= limit else 'NOT launched (memory plan only)'}")
    job.out.parent.mkdir(parents=True, exist_ok=True)
    job.out.with_suffix(".memory.md").write_text(format_plan(plan) + f"\n\n{verdict}\n")
    atomic_write_json(job.out.with_suffix(".memory.json"), {**plan.to_dict(), "verdict": verdict})
    return None if need <= limit else verdict


def failure_summary(*outputs: str, limit: int = 4) -> str:
    """Why a launched run failed, in one line: the ranks' own ``error: ...`` lines and the launcher's
    per-rank exit codes (torchrun and accelerate end with a banner whose last lines name neither),
    else the last 3 lines."""
    lines = [ln.strip() for text in outputs for ln in (text or "").splitlines() if ln.strip()]
    cause = [ln for ln in lines if ln.startswith("error: ") or ln.startswith("exitcode")]
    picked = list(dict.fromkeys(cause))[:limit] or lines[-3:]
    return " | ".join(picked)


def _launch_one(job: Job, profile: str, launcher: LauncherConfig, gpu_ids: list[int], fingerprint: str) -> dict:
    from .launch import launch             # the one place runs are launched
    if launcher.memory_gib:
        refusal = _memory_refusal(job, launcher)
        if refusal:
            return {"k": job.k, "run": job.name, "skipped": refusal}
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else {}
    reuse.mark_code(job.ckpt, fingerprint)
    emit(f"run {job.k} of {job.n} {job.name}: {launcher.kind} launch of {job.cfg.stages} processes"
         + (f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if gpu_ids else " on this host"))
    res = launch(launch_args(job, profile), job.cfg.stages, launcher=launcher.kind, env=env)
    if res.returncode != 0:
        return {"k": job.k, "run": job.name, "error": f"exit {res.returncode}: {failure_summary(res.stderr, res.stdout)}"}
    reuse.stamp_results(job.out, fingerprint)
    return {"k": job.k, "run": job.name, "action": job.action, "wall_s": round(res.wall_s, 1)}


def _run_launched(jobs: list[Job], profile: str, launcher: LauncherConfig, fingerprint: str,
                  clock: GroupClock | None) -> list[dict]:
    """Runs in order; each starts when its P GPUs are free (on CPU, gpus = 0: one run at a time)."""
    for j in jobs:
        if launcher.gpus and j.cfg.stages > launcher.gpus:
            raise ConfigError(f"run {j.name} needs {j.cfg.stages} GPUs (one per stage) but launcher.gpus="
                              f"{launcher.gpus}")
    free, cond, results, threads = list(range(launcher.gpus or 1)), threading.Condition(), [], []

    def one(job: Job, slots: list[int]) -> None:
        try:
            st = _launch_one(job, profile, launcher, slots if launcher.gpus else [], fingerprint)
        except Exception as e:       # noqa: BLE001 -- reported with the group, like a pool run
            st = {"k": job.k, "run": job.name, "error": f"{type(e).__name__}: {e}"}
        if clock:
            clock.finished(job, "failed" if "error" in st else "not launched" if "skipped" in st else "done")
        with cond:
            free.extend(slots)
            results.append(st)
            cond.notify_all()

    for job in jobs:
        need = job.cfg.stages if launcher.gpus else 1
        with cond:
            cond.wait_for(lambda: len(free) >= need)
            slots, free[:] = sorted(free)[:need], sorted(free)[need:]
        threads.append(threading.Thread(target=one, args=(job, slots), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    return results


def prepare_data(cfgs: list[RunConfig]) -> None:
    """Each dataset the runs read, prepared once here (idempotent), never by two runs side by side
    or by a pipeline's stage processes."""
    from .. import data as mdata
    from ..core.engine import resolve_data_dir
    for data_dir, cfg in {resolve_data_dir(c): c for c in cfgs}.items():
        mdata.prepare(cfg.data, data_dir)


def status_table(status: list[dict]) -> str:
    """The group's outcome as Markdown: one row per run (what happened, val loss, wall time)."""
    rows = ["| # | run | outcome | val loss | wall (s) |", "|---|---|---|---|---|"]
    for s in status:
        done = {"restore": "restored from its checkpoint", "resume": f"resumed at step {s.get('from_step', 0)}"}
        outcome = s.get("error") or s.get("skipped") or done.get(s.get("action"), "trained")
        val = f"{s['val_loss']:.4f}" if "val_loss" in s else ""
        rows.append(f"| {s['k']} | {s['run']} | {outcome} | {val} | {s.get('wall_s', '')} |")
    return "\n".join(rows)


def stage_table(out_dir: Path) -> str:
    """Per stage of every multi-process run in ``out_dir``: compute, optimizer and waiting seconds per
    step (measured), and peak memory (the memory plan's, and the measured one where the results carry
    ``pipeline.stage_peak_memory_bytes``: on a GPU the tensors' peak, on a CPU the process's peak RSS,
    which includes the Python/torch runtime). Empty when no run of the folder ran multi-process."""
    import json
    rows = ["| run | step (s) | stage | compute (s) | optimizer (s) | waiting (s) | peak memory plan (GiB) | "
            "peak memory measured (GiB; GPU: tensors, CPU: process RSS) |", "|---|---|---|---|---|---|---|---|"]
    for path in sorted(Path(out_dir).glob("*.json")):
        res = json.loads(path.read_text())
        pipe = res.get("pipeline") if isinstance(res, dict) else None
        if not pipe:
            continue
        plan_path = path.with_suffix(".memory.json")
        planned = [s["total"] for s in json.loads(plan_path.read_text())["stages"]] if plan_path.exists() else []
        measured = pipe.get("stage_peak_memory_bytes") or []

        def cell(xs, s, scale=1.0, fmt="{:.2f}"):
            return fmt.format(xs[s] / scale) if s < len(xs) and xs[s] is not None else "—"
        for s in range(pipe["processes"]):
            rows.append(f"| {res['run'] if s == 0 else ''} | {cell([pipe['step_wall_s']], s) if s == 0 else ''} | {s} | "
                        f"{cell(pipe['stage_compute_s_per_step'], s)} | {cell(pipe['stage_opt_s_per_step'], s)} | "
                        f"{cell(pipe['stage_wait_s_per_step'], s)} | {cell(planned, s, 2**30)} | {cell(measured, s, 2**30)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def group_lock_path(profile: str, out_dir: Path) -> Path:
    """The lock a sweep (or ``mapl reuse adopt``) holds on a group's results folder while it runs
    (:func:`mapl.orchestration.groups.group_lock`)."""
    return group_lock(profile, Path(out_dir).name, PROJECT_ROOT)


def hold_group(profile: str, out_dir: Path, group: str = "",
               why: str = "a second sweep would train the same runs") -> OutputLock:
    """The group's lock, held; held by another process, an OutputError naming it and ``why``."""
    return hold_group_lock(group_lock_path(profile, out_dir), profile, group or Path(out_dir).name, why)


def run_many(profile: str, specs: list[dict], out_dir: Path, jobs: int = 0, log=print, group: str = "",
             progress_every: float = 5.0) -> list[dict]:
    """Train every spec that is not current; one status dict per spec. ``jobs``: runs side by side
    (0 = the profile's launcher); ``progress_every``: seconds between progress lines (0 = quiet). A second sweep
    of the same group (or ``mapl reuse refresh`` of its stage) while this one runs is refused at once."""
    lock = hold_group(profile, out_dir, group)
    try:
        return _run_many(profile, specs, out_dir, jobs, log, group, progress_every)
    finally:
        lock.release()


def _run_many(profile: str, specs: list[dict], out_dir: Path, jobs: int, log, group: str,
              progress_every: float) -> list[dict]:
    params = load_params()
    launcher = launcher_config(profile, params)
    if jobs:
        launcher = replace(launcher, jobs=jobs)
    fingerprint = code_fingerprint()
    plan = plan_group(profile, specs, out_dir, params, fingerprint, log)
    skipped = {"current": "current", "copied": "copied from another group (same config and training code)"}
    status = [{"k": j.k, "run": j.name, "skipped": skipped[j.action]} for j in plan if j.action in reuse.DONE]
    todo = [j for j in plan if j.action not in reuse.DONE]
    counts = {a: sum(j.action == a for j in todo) for a in reuse.ACTIONS if a not in reuse.DONE}
    copied = sum(j.action == "copied" for j in plan)
    summary = (f"{len(plan)} run(s): {len(status) - copied} current, {copied} copied, "
               + ", ".join(f"{v} to {a}" for a, v in counts.items()))
    log(summary)
    if progress_every:
        names = group_names(profile, params)
        where = f" ({names.index(group) + 1} of {len(names)} groups)" if group in names else ""
        emit(f"group {group or Path(out_dir).name}{where}: {summary}")
    clock = GroupClock(group or Path(out_dir).name, todo) if progress_every and todo else None
    prepare_data([j.cfg for j in todo])
    if launcher.kind == "pool" and todo:
        status += list(_run_pool(todo, launcher.jobs, progress_every, fingerprint, clock))
    elif todo:
        status += _run_launched(todo, profile, launcher, fingerprint, clock)
    stopped = [s for s in status if "interrupted" in s]
    if stopped:
        from ..core.loop import Interrupted
        raise Interrupted(f"group {group or Path(out_dir).name} stopped by a signal during {stopped[0]['run']} "
                          f"({stopped[0]['interrupted']}); rerun the same command to resume")
    failed = [s for s in status if "error" in s]
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: " + "; ".join(f"{s['run']}: {s['error']}" for s in failed))
    return sorted(status, key=lambda s: s["k"])
