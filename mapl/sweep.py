"""Run a group of training runs from params.yaml, several side by side (one thread each).

A profile lists run groups (``profiles.<p>.groups.<name>``: a list of run specs). A spec is a dict of
overrides understood by :func:`mapl.config.load_run_config` (``method``, ``ratio``, ``train.seed``,
``compressor.anchor``, ...) plus an optional ``name``. Results go to ``reports/results/<group>/<run>.json``;
a run whose results JSON exists with the same config hash is skipped, and an interrupted run resumes
from its checkpoint. Two single-thread runs side by side use 2 cores better than one 2-thread run.

    python -m mapl.sweep --profile cpu --group main --jobs 2
    python -m mapl.sweep --profile cpu --group tune --jobs 2     # the tuning protocol (README)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from .config import PROJECT_ROOT, RunConfig, config_hash, load_params, load_run_config

__all__ = ["group_specs", "spec_config", "run_many", "main"]


def group_specs(profile: str, group: str, params: dict | None = None) -> list[dict]:
    params = params or load_params()
    groups = params["profiles"][profile].get("groups", {})
    if group not in groups:
        raise ValueError(f"group={group!r} is invalid for profile {profile!r}: allowed {sorted(groups)}")
    return [dict(s) for s in (groups[group] or [])]


def spec_config(profile: str, spec: dict, params: dict | None = None) -> RunConfig:
    spec = dict(spec)
    name = spec.pop("name", "")
    cfg = load_run_config(profile, spec, params=params)
    if name:
        from dataclasses import replace
        cfg = replace(cfg, run_name=name)
    return cfg


def _result_is_current(path: Path, cfg: RunConfig) -> bool:
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return res.get("provenance", {}).get("config_hash") == config_hash(cfg) and res.get("steps") == cfg.train.steps


def _worker(args):
    cfg, out, ckpt = args
    import torch
    torch.set_num_threads(1)
    from .train import run
    t0 = time.time()
    try:
        res = run(cfg, out=out, ckpt=ckpt, progress=False, log=lambda *a: None)
    except Exception as e:           # one failed run must not take the group down; it is reported
        return {"run": cfg.name(), "error": f"{type(e).__name__}: {e}"}
    return {"run": cfg.name(), "val_loss": res["val_loss"], "wall_s": round(time.time() - t0, 1)}


def run_many(profile: str, specs: list[dict], out_dir: Path, jobs: int = 2, log=print) -> list[dict]:
    """Train every spec (skipping current results); returns one status dict per spec."""
    params = load_params()
    todo, status = [], []
    for spec in specs:
        cfg = spec_config(profile, spec, params)
        out = Path(out_dir) / f"{cfg.name()}.json"
        if _result_is_current(out, cfg):
            status.append({"run": cfg.name(), "skipped": True})
            continue
        todo.append((cfg, out, PROJECT_ROOT / "checkpoints" / profile / f"{cfg.name()}.pt"))
    # validate everything before any work starts (a bad spec fails the group up front)
    for cfg, _, _ in todo:
        cfg.validate()
    log(f"{len(todo)} run(s) to train, {len(status)} current; {jobs} side by side")
    if not todo:
        return status
    ctx = mp.get_context("spawn")      # fresh interpreters: no torch thread pools inherited from the parent
    with ctx.Pool(min(jobs, len(todo)), maxtasksperchild=1) as pool:
        for st in pool.imap_unordered(_worker, todo):
            log(json.dumps(st))
            status.append(st)
    failed = [s for s in status if "error" in s]
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {failed}")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mapl.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=load_params().get("profile", "cpu"))
    ap.add_argument("--group", required=True, help="run group in params.yaml profiles.<profile>.groups")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MAPL_JOBS", 2)))
    ap.add_argument("--out-dir", type=Path, help="default reports/results/<group>")
    args = ap.parse_args(argv)
    try:
        specs = group_specs(args.profile, args.group)
        run_many(args.profile, specs, args.out_dir or PROJECT_ROOT / "reports" / "results" / args.group, args.jobs)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
