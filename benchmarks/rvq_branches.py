"""Why MAPL+RVQ blew up on seed 1: branch the run at step 1,200 and change one thing per branch.

Writes: ``reports/bench/rvq-branches.json``, ``reports/tables/rvq-branches.md``.

The cpu profile's ``tiny-P4-mapl-rvq-8x-3000steps-s1`` grows activation outliers at boundary 1 from
~step 1,300 and diverges after step 2,370. Training is deterministic (same seed, same machine: same
losses), so the run is replayed once to the branch step with a checkpoint, and every branch continues
that checkpoint with one intervention, to ``--until``:

    baseline         nothing changed (must repeat the outlier growth of the committed run)
    sync-full        compressor.rvq.sync=full: no streamed staleness (hypothesis H2)
    scale-token      compressor.rvq.scale=token: per-token RMS scale on the wire, the codes quantise z/RMS
                     (H1: fixed-resolution codes decode an outlier with an error the size of itself);
                     the codebooks are re-initialised by k-means at the branch (they were learned on z)
    weight-decay     train.weight_decay=0.1 (Muon's decoupled decay; H3)

Each branch records the boundary-health trajectories (mapl/core/compress/health.py: max |z| per boundary
every 50 steps, codebook norms, decoding error of the largest token) and the losses. Writes
``reports/bench/rvq-branches.json`` (after every branch: an interrupted study keeps what it has and
skips finished branches when rerun) and ``reports/tables/rvq-branches.md``.

    python benchmarks/rvq_branches.py                      # ~35 min on 2 cores (2 branches at a time)
    python benchmarks/rvq_branches.py --branches baseline,scale-token --until 2000
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.core.checkpoint import read as read_checkpoint
from mapl.core.config import config_hash, load_run_config
from mapl.orchestration import sweep
from mapl.base.io import atomic_torch_save, atomic_write_json, atomic_write_text

# The committed run: the long group's MAPL+VQ 8x seed 1 (params.yaml, profiles.cpu.groups.long).
RUN = {"method": "mapl-rvq", "ratio": 8, "train.steps": 3000, "train.warmup_steps": 300, "train.eval_every": 250,
       "train.seed": 1}
BRANCHES = {
    "baseline": {},
    "sync-full": {"compressor.rvq.sync": "full"},
    "scale-token": {"compressor.rvq.scale": "token"},
    "weight-decay": {"train.weight_decay": 0.1},
}
# a branch whose quantiser sees another space than the codebooks were learned in restarts them by k-means
REINIT_CODEBOOKS = {"scale-token"}


HEALTH_EVERY = 50


def run_config(profile: str, overrides: dict, health_every: int = HEALTH_EVERY):
    return load_run_config(profile, {**RUN, **overrides, "train.threads": 1, "train.health_every": health_every})


class _StopAt:
    """Wraps an engine so the loop stops (checkpoint written and confirmed) after step ``until``."""

    def __init__(self, engine, until: int):
        self._engine, self._until = engine, until

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def train_step(self, step, lr_scale, stop_requested=lambda: False):
        return self._engine.train_step(step, lr_scale, lambda: stop_requested() or step + 1 >= self._until)


def train_until(cfg, ckpt: Path, until: int) -> dict:
    """Run (or resume) ``cfg`` with checkpoint ``ckpt`` until step ``until``; the loop state as a dict."""
    from mapl.core.engine import LocalEngine
    from mapl.core.loop import Interrupted, LoopState, run_loop
    engine = LocalEngine.build(cfg, ckpt=ckpt)
    state = engine.resume() or LoopState()
    if state.step < until:
        try:
            run_loop(_StopAt(engine, until), state, progress=False, log=lambda msg: print(msg, flush=True))
        except Interrupted:
            if state.step < until:          # a signal, not our stop: the checkpoint is written, rerun resumes
                raise
    return state.to_dict()


def branch_checkpoint(src: Path, dst: Path, cfg, name: str) -> None:
    """A copy of checkpoint ``src`` that continues as ``cfg`` (the branch's settings, recorded in the
    state's ``resumed_with_changes``); with REINIT_CODEBOOKS the RVQ codebooks start again by k-means."""
    import torch

    from mapl.core.engine import LocalEngine
    ck = read_checkpoint(src)
    changes = {k: v for k, v in BRANCHES[name].items()}
    engine = LocalEngine.build(cfg)
    cfg = engine.cfg                                 # validated and resolved, as a checkpoint stores it
    ck["config"], ck["config_hash"] = cfg.to_dict(), config_hash(cfg)
    # another sync mode keeps other state: the stream's cursor and order do not exist under "full"
    wanted = set(engine.sm.state_dict())
    for key in [k for k in ck["model"] if k not in wanted and ".sync." in k]:
        del ck["model"][key]
    # the last message's sync tensors, kept to update the sender's shadow of the receiver copy, are in
    # the old mode's layout; in one process the receiver copy has applied them already (unpack follows
    # pack), so the shadow is current without them
    for key, value in ck["model"].items():
        if key.endswith("._extra_state") and isinstance(value, dict) and "pending" in value:
            value["pending"] = None
    ck["state"].setdefault("resumed_with_changes", []).append({"step": ck["state"]["step"], "branch": name,
                                                              "changes": changes})
    if name in REINIT_CODEBOOKS:
        for key in ck["model"]:
            if key.endswith(("rvq.initted", "recv.initted")):
                ck["model"][key] = torch.tensor(False)
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(ck, dst)


def summarise(state: dict, start: int, cfg) -> dict:
    """Per boundary: the max |z| trajectory after the branch step, its largest value, the losses, and
    the outlier warnings derived from all its readings under this code's rule (mapl.core.loop)."""
    from mapl.core.loop import ALARM_AFTER_WARMUPS, LoopState, outlier_alarm
    st = LoopState.from_dict(state)
    outlier_alarm(st, cfg.train.health_warn_factor, ALARM_AFTER_WARMUPS * cfg.train.warmup_steps)
    state = {**state, "health_warnings": st.health_warnings}
    readings = [r for r in state["health"] if r["step"] > start]
    n_b = len(readings[0]["boundaries"]) if readings else 0
    traj = {str(p): [[r["step"], r["boundaries"][p]["train_max"]] for r in readings] for p in range(n_b)}
    peak = {p: max((v for _, v in t if v is not None), default=None) for p, t in traj.items()}
    rms = {str(p): max((r["boundaries"][p]["train_rms"] or 0.0) for r in readings) for p in range(n_b)}
    cw = {str(p): max((r["boundaries"][p].get("codeword_max_sender") or 0.0) for r in readings) for p in range(n_b)}
    return {"max_abs_z": traj, "peak_max_abs_z": peak, "peak_rms": rms, "peak_codeword": cw,
            "val_loss_curve": [v for v in state["val_curve"] if v[0] >= start],
            "final_train_loss": state["train_curve"][-1][1] if state["train_curve"] else None,
            "final_step": state["step"], "warnings": state["health_warnings"]}


def _branch_job(args) -> tuple[str, dict]:
    name, profile, base_ckpt, work, at, until, every = args
    import torch
    torch.set_num_threads(1)
    cfg = run_config(profile, BRANCHES[name], every)
    ckpt = Path(work) / f"branch-{name}.pt"
    if not ckpt.exists():
        branch_checkpoint(Path(base_ckpt), ckpt, cfg, name)
    t0 = time.time()
    state = train_until(cfg, ckpt, until)
    return name, {"overrides": BRANCHES[name], "wall_s": time.time() - t0, **summarise(state, at, cfg)}


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def markdown(res: dict) -> str:
    at, until = res["branch_step"], res["until"]
    n_b = max((len(b["peak_max_abs_z"]) for b in res["branches"].values()), default=0)
    lines = [f"# Branches of `{res['run']}` at step {at:,} (to step {until:,})", "",
             "Largest max |z| per boundary over the branch (training messages, read every "
             f"{res['health_every']} steps); in the committed run, boundary 1's running max |z| was 54 at step 1,200 "
             "and 95,976 at step 2,300.", "",
             "| branch | changes | " + " | ".join(f"max \\|z\\| b{p}" for p in range(n_b))
             + " | largest RMS | largest sender codeword | last val loss (step) | outlier warnings |",
             "|---|---|" + "---|" * n_b + "---|---|---|---|"]
    for name, b in res["branches"].items():
        vals = [b["peak_max_abs_z"].get(str(p)) for p in range(n_b)]
        val = f"{b['val_loss_curve'][-1][1]:.4f} ({b['val_loss_curve'][-1][0]:,})" if b["val_loss_curve"] else "—"
        ch = ", ".join(f"{k}={v}" for k, v in b["overrides"].items()) or "—"
        rms = "/".join(f"{b['peak_rms'][str(p)]:.3g}" for p in range(n_b))
        cw = max(b["peak_codeword"].values(), default=0.0)
        warn = ", ".join(f"b{w['boundary']}@{w['step']}" for w in b["warnings"] if w["step"] > at) or "none"
        lines.append(f"| {name} | {ch} | " + " | ".join("—" if v is None else _num(v) for v in vals)
                     + f" | {rms} | {_num(cw)} | {val} | {warn} |")
    same = res["replay_matches_committed"]
    lines += ["", f"Replay to step {at:,} on this machine: bit-identical to the committed curve: {same}"
              + ("" if same in (True, None) else
                 f" (the first step's loss is {res['replay_first_step_loss'][0]!r} here, "
                 f"{res['replay_first_step_loss'][1]!r} in the committed run: another machine's float rounding, "
                 "and the trajectories part from step 1 on)") + ".",
              "Each branch continues the same checkpoint; only its changes differ. Written by `benchmarks/rvq_branches.py`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--at", type=int, default=1200, help="branch step (default 1200)")
    ap.add_argument("--until", type=int, default=2400, help="last step of every branch (default 2400)")
    ap.add_argument("--branches", default=",".join(BRANCHES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--health-every", type=int, default=HEALTH_EVERY, help="steps between health readings")
    ap.add_argument("--work", default=str(ROOT / "checkpoints/rvq-branches"))
    ap.add_argument("--json", default=str(ROOT / "reports/bench/rvq-branches.json"))
    ap.add_argument("--md", default=str(ROOT / "reports/tables/rvq-branches.md"))
    args = ap.parse_args(argv)
    names = args.branches.split(",")
    unknown = [n for n in names if n not in BRANCHES]
    if unknown:
        ap.error(f"--branches: unknown {unknown}; allowed: {', '.join(BRANCHES)}")
    work = Path(args.work)
    out = Path(args.json)
    res = json.loads(out.read_text()) if out.exists() else {}
    if res.get("branch_step") != args.at or res.get("until") != args.until:
        res = {}
    base_cfg = run_config(args.profile, {}, args.health_every)
    res.update({"run": base_cfg.name(), "profile": args.profile, "branch_step": args.at, "until": args.until,
                "health_every": args.health_every,
                "config_hash": config_hash(base_cfg)})
    res.setdefault("branches", {})
    base = work / "replay.pt"
    t0 = time.time()
    replay = train_until(base_cfg, base, args.at)
    committed = ROOT / f"reports/{args.profile}/results/long/{sweep.run_name(base_cfg, 300)}.json"
    if committed.exists():                      # the same run of group long (its name carries the budget)
        ref = json.loads(committed.read_text())["train_loss_curve"][:args.at]
        res["replay_matches_committed"] = ref == replay["train_curve"][:args.at]
        res["replay_first_step_loss"] = [replay["train_curve"][0][1], ref[0][1]]
        res["replay_val_loss_at_branch"] = [replay["val_curve"][-1], json.loads(committed.read_text())[
            "val_loss_curve"][(args.at // 250) - 1]]
    else:
        res["replay_matches_committed"] = None
    res["replay_wall_s"] = time.time() - t0
    for name in [n for n in names if n in res["branches"]]:   # finished: warnings under this code's rule
        ckpt = work / f"branch-{name}.pt"
        if ckpt.exists():
            done = read_checkpoint(ckpt)["state"]
            res["branches"][name] = {**res["branches"][name],
                                     **summarise(done, args.at, run_config(args.profile, BRANCHES[name]))}
    todo = [n for n in names if n not in res["branches"]]
    jobs = [(n, args.profile, str(base), str(work), args.at, args.until, args.health_every) for n in todo]
    with mp.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        for name, summary in pool.imap_unordered(_branch_job, jobs):
            res["branches"][name] = summary
            atomic_write_json(out, res)
            print(f"{name}: peak max|z| {summary['peak_max_abs_z']}  val {summary['val_loss_curve'][-1:]}", flush=True)
    res["branches"] = {n: res["branches"][n] for n in BRANCHES if n in res["branches"]}
    atomic_write_json(out, res)
    atomic_write_text(Path(args.md), markdown(res))
    return res


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
