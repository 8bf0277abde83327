"""When does compression pay? Steps to target, time to target, crossover bandwidths (notebooks/when_it_pays).

Time to target = steps to target x step time. Step times come from :mod:`mapl.costmodel`; steps to target
from our own loss curves (:func:`steps_ratios`: each method against uncompressed, per seed and budget)
or, at paper scale, from the paper's final-loss penalties converted with a loss-vs-tokens fit
(:func:`ratio_from_penalty`).

The conversion. At a fixed model size, ``L(D) = L_inf + B D^-beta`` (D tokens). If a method's final loss
sits ``delta`` above uncompressed after D0 tokens and the method behaves like uncompressed training on
k x D0 tokens, then ``B (k D0)^-beta = B D0^-beta + delta`` and it needs ``1/k = (1 + delta /
(B D0^-beta))^(1/beta)`` times the steps to reach uncompressed's final loss. B, beta: Chinchilla's fit
(Hoffmann et al. 2022, approach 3: B = 410.7, beta = 0.28) and its replication (Besiroglu et al. 2024:
B = 2085.43, beta = 0.3658); the two bracket the ratio. It assumes the penalty is lost token efficiency;
a penalty that stays constant with more tokens would never be made up (ratio unbounded).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .config import METHODS

__all__ = ["LOSS_FITS", "load_runs", "main_model_runs", "steps_to_target", "steps_ratios", "ratio_trend", "ratio_from_penalty",
           "paper_steps_ratios", "time_to_target_rows", "crossover_bandwidth", "crossover_interval",
           "speedup_grid", "validated_error", "ratio_key"]

LOSS_FITS = {
    "chinchilla": {"B": 410.7, "beta": 0.28, "source": "Hoffmann et al. 2022, approach 3"},
    "besiroglu": {"B": 2085.43, "beta": 0.3658, "source": "Besiroglu et al. 2024, Chinchilla replication"},
}


def steps_to_target(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """First step at which a validation curve reaches ``target`` (linear between evaluations)."""
    from .link import steps_to_target as s2t
    return s2t(curve, target)


def _is_default(r: dict) -> bool:
    """A run of the method's default configuration (no ablation, tuning split or sync variant)."""
    d = METHODS.get(r["method"])
    cfg = r.get("config") or {}
    comp, train = cfg.get("compressor", {}), cfg.get("train", {})
    return (d is not None and r.get("projector") == d["projector"] and r.get("anchor") == d["anchor"]
            and not train.get("eval_offset") and (comp.get("rvq") or {}).get("sync", comp.get("rvq_sync", "stream")) == "stream")


def load_runs(results_dir: str | Path, groups: Iterable[str] | None = None) -> list[dict]:
    """Default-configured runs under ``results_dir/<group>/*.json`` (all groups unless given)."""
    root = Path(results_dir)
    files = sorted(root.glob("*/*.json")) if groups is None else sorted(f for g in groups for f in (root / g).glob("*.json"))
    runs = []
    for f in files:
        r = json.loads(f.read_text())
        if not isinstance(r, dict) or not r.get("val_loss_curve") or not _is_default(r):
            continue
        runs.append({"run": r["run"], "group": f.parent.name, "method": r["method"], "ratio": float(r["ratio"]),
                     "steps": int(r["steps"]), "seed": int(r["provenance"]["seed"]), "model": r["model"],
                     "final": float(r["val_loss"]), "curve": r["val_loss_curve"]})
    return runs


def ratio_key(method: str, ratio: float) -> tuple[str, float]:
    """(method, effective wire ratio rounded to 3 decimals): how runs and measured steps are matched."""
    return (method, 1.0 if method == "none" else round(float(ratio), 3))


def main_model_runs(runs: Sequence[dict]) -> list[dict]:
    """The runs of the model with the most runs (a profile's main model; scaling runs are left out)."""
    counts = defaultdict(int)
    for r in runs:
        counts[r["model"]] += 1
    main = min(counts, key=lambda m: (-counts[m], m)) if counts else None
    return [r for r in runs if r["model"] == main]


def _key(r: dict) -> tuple:
    return ratio_key(r["method"], r["ratio"])


def steps_ratios(runs: Sequence[dict], target_pct: float = 2.0) -> list[dict]:
    """Per (method, ratio, budget): steps to reach uncompressed's final loss + ``target_pct`` %, divided
    by uncompressed's steps to it, paired by seed (same budget and seed), then mean/min/max over seeds.
    A run that never gets there within its budget gives a lower bound (``censored``)."""
    dense = {(r["model"], r["steps"], r["seed"]): r for r in runs if r["method"] == "none"}
    per = defaultdict(list)
    for r in runs:
        ref = dense.get((r["model"], r["steps"], r["seed"]))
        if r["method"] == "none" or ref is None:
            continue
        target = ref["final"] * (1 + target_pct / 100)
        n_ref, n = steps_to_target(ref["curve"], target), steps_to_target(r["curve"], target)
        if not n_ref:
            continue
        per[(r["model"], *_key(r), r["steps"])].append((n / n_ref if n is not None else r["steps"] / n_ref, n is None))
    out = []
    for (model, method, ratio, budget), vals in sorted(per.items()):
        xs = [v for v, _ in vals]
        out.append({"model": model, "method": method, "ratio": ratio, "budget": budget, "seeds": len(xs),
                    "mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs),
                    "censored": sum(c for _, c in vals), "target_pct": target_pct})
    return out


def ratio_trend(runs: Sequence[dict]) -> list[dict]:
    """Along the longest budget: for each evaluation step s of uncompressed (same seed), the steps a method
    needs to reach uncompressed's loss at s, divided by s (None: not reached within the run)."""
    longest = max((r["steps"] for r in runs), default=0)
    dense = {r["seed"]: r for r in runs if r["method"] == "none" and r["steps"] == longest}
    out = []
    for r in runs:
        ref = dense.get(r["seed"])
        if r["method"] == "none" or r["steps"] != longest or ref is None:
            continue
        for s, loss in ref["curve"]:
            n = steps_to_target(r["curve"], loss)
            out.append({"method": r["method"], "ratio": r["ratio"], "seed": r["seed"], "step": s,
                        "dense_loss": loss, "steps_ratio": None if n is None else n / s})
    return out


def ratio_from_penalty(delta_loss: float, tokens: float, fit: str = "chinchilla") -> float:
    """Steps-to-target ratio implied by a final-loss penalty ``delta_loss`` after ``tokens`` (module doc)."""
    f = LOSS_FITS[fit]
    reducible = f["B"] * tokens ** -f["beta"]
    base = 1 + delta_loss / reducible
    return base ** (1 / f["beta"]) if base > 0 else 0.0


def paper_steps_ratios(scale: str, stages: int = 4, tokens: float | None = None) -> dict:
    """Steps ratio per method at a paper scale, from Table 1's penalties, as (low, high) over the fits."""
    from .report import paper_table1
    rows = [e for e in paper_table1(stages=stages) if e["scale"] == scale]
    base = next(e for e in rows if e["method"] == "none")["val_loss"]
    n_params = {"150M": 150e6, "500M": 500e6, "1B": 1e9}[scale]
    tokens = tokens or 20 * n_params
    out = {"none": {"low": 1.0, "high": 1.0, "delta": 0.0}}
    for e in rows:
        if e["method"] == "none":
            continue
        delta = base * e["delta_pct"] / 100            # the paper's percentages come from unrounded losses
        rs = [ratio_from_penalty(delta, tokens, f) for f in LOSS_FITS]
        out[e["method"]] = {"low": min(rs), "high": max(rs), "delta": delta, "ratio": e["ratio"],
                            "proj_ratio": e["proj_ratio"]}
    return out


def time_to_target_rows(runs: Sequence[dict], cases: dict, bandwidths: Sequence[float], latency_s: float = 0.0,
                        target_pct: float = 2.0) -> list[dict]:
    """The measured time-to-target table's rule (mapl.report): one target, the longest uncompressed run's
    final loss + ``target_pct`` %; steps on the longest run of each (method, ratio); times on each link
    from ``cases`` ((method, ratio) -> costmodel.Case)."""
    from .link import LinkProfile
    dense = [r for r in runs if r["method"] == "none"]
    ref = max(dense, key=lambda r: (r["steps"], -r["seed"]))
    target = ref["final"] * (1 + target_pct / 100)
    out = []
    for key, case in cases.items():
        cands = [r for r in runs if _key(r) == key]
        if not cands:
            continue
        run = max(cands, key=lambda r: (r["steps"], -r["seed"]))
        n = steps_to_target(run["curve"], target)
        for bw in bandwidths:
            st = case.step_time(LinkProfile(f"{bw:g}", bw, latency_s))
            out.append({"method": key[0], "ratio": key[1], "run": run["run"], "bandwidth_bps": bw, "target": target,
                        "steps_to_target": n, "step_s": st, "time_s": None if n is None else n * st})
    return out


def crossover_bandwidth(time_a: Callable[[float], float], time_b: Callable[[float], float],
                        lo: float = 1e5, hi: float = 1e12, iters: int = 50) -> float:
    """Bandwidth (bit/s) below which ``a`` is faster (``time_a < time_b``), by bisection in log bandwidth:
    ``math.inf`` if a is faster at both ends of [lo, hi], 0.0 if it is slower at both; if a is faster only
    at the high end, the bandwidth *above* which it is faster (``crossover_side`` tells which)."""
    f = lambda bw: time_a(bw) - time_b(bw)           # noqa: E731
    flo, fhi = f(lo), f(hi)
    if (flo < 0) == (fhi < 0):
        return math.inf if flo < 0 else 0.0
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        mid = (a + b) / 2
        if (f(math.exp(mid)) < 0) == (flo < 0):
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def crossover_interval(step_a, steps_a: tuple[float, float], step_b, steps_b: tuple[float, float],
                       rel_err: float, **kw) -> dict:
    """Crossover of method a against b (see :func:`crossover_bandwidth`) with its uncertainty: the
    step-time model's relative error applied against a and for b (and the reverse), with each side's
    steps range (low, high). ``low``/``high`` bracket ``mid``."""
    def cross(ka, kb, na, nb):
        return crossover_bandwidth(lambda bw: na * ka * step_a(bw), lambda bw: nb * kb * step_b(bw), **kw)
    mid = cross(1, 1, sum(steps_a) / 2, sum(steps_b) / 2)
    ends = [cross(1 + rel_err, 1 - rel_err, steps_a[1], steps_b[0]), cross(1 - rel_err, 1 + rel_err, steps_a[0], steps_b[1])]
    return {"mid": mid, "low": min(ends + [mid]), "high": max(ends + [mid])}


def speedup_grid(cases: dict, steps: dict, bandwidths: Sequence[float], latencies: Sequence[float],
                 reference: str = "none") -> dict:
    """time_to_target(reference) / time_to_target(method) on every (latency, bandwidth):
    ``{method: [[speedup per bandwidth] per latency]}``; ``steps`` maps method -> steps to target."""
    from .link import LinkProfile
    grid = {}
    for lat in latencies:
        links = [LinkProfile(f"{bw:g}", bw, lat) for bw in bandwidths]
        ref = [steps[reference] * cases[reference].step_time(lk) for lk in links]
        for m, case in cases.items():
            grid.setdefault(m, []).append([r / (steps[m] * case.step_time(lk)) for r, lk in zip(ref, links)])
    return grid


def validated_error(path: str | Path, min_comm: float = 0.25, default: float | None = None) -> float | None:
    """Largest |relative error| of the cost model in the validation table (``reports/bench/
    costmodel-validation.json``) over cells where communication is at least ``min_comm`` of the step."""
    path = Path(path)
    if not path.exists():
        return default
    cells = json.loads(path.read_text())["cells"]
    errs = [abs(c["error"]) for c in cells if c["comm_fraction"] >= min_comm and c.get("error") is not None]
    return max(errs) if errs else default
