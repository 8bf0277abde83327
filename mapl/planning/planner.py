"""When does compression pay? Steps to target, time to target, crossover bandwidths (notebooks/when_it_pays).

Time to target = steps to target (our loss curves, or the paper's penalties through a loss-vs-tokens fit) x step
time (mapl.planning.costmodel).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from ..core.link import LinkProfile, steps_to_target
from ..report import paper_table1
from ..report.rows import at_best_validation, is_reference, load_results, main_model, select
from ..report.studies.ttt import common_target, method_curve, on_target_set   # the report's target, re-used

__all__ = ["LOSS_FITS", "load_runs", "main_model_runs", "steps_ratios", "ratio_trend", "steps_ratio_table",
           "steps_report", "ratio_from_penalty", "paper_steps_ratios", "common_target", "time_to_target_rows",
           "crossover_bandwidth", "crossover_interval", "speedup_grid", "validated_error", "ratio_key", "label"]

LOSS_FITS = {          # B and beta of L(D) = L_inf + B D^-beta
    "chinchilla": {"B": 410.7, "beta": 0.28, "source": "Hoffmann et al. 2022, approach 3"},
    "besiroglu": {"B": 2085.43, "beta": 0.3658, "source": "Besiroglu et al. 2024, Chinchilla replication"},
}


def load_runs(results_dir: str | Path, variants: bool = False) -> list[dict]:
    """The report's rows of the runs under ``results_dir`` with a validation curve (default configurations only)."""
    return [r for r in select(load_results("", Path(results_dir).resolve()))
            if r["val_loss_curve"] and (variants or r["variant"] == r["method"])]


def ratio_key(method: str, ratio: float | None) -> tuple[str, float]:
    """(method, wire ratio to 3 significant digits, as the report rounds it): how runs and cases are matched."""
    return (method, 1.0 if method == "none" or ratio is None else float(f"{float(ratio):.3g}"))


def label(key) -> str:
    """'mapl 8x' for ('mapl', 8.0), 'mapl-fixed 8x' for a variant; 'none' for the uncompressed run."""
    m, r = key if isinstance(key, tuple) else (key, 1.0)
    return m if m == "none" else f"{m} {r:g}x"


def main_model_runs(runs: Sequence[dict]) -> list[dict]:
    """The runs of the profile's main model (width studies left out)."""
    main = main_model(runs)
    return [r for r in runs if r["model"] == main]


def _spread(values: Sequence[float]) -> dict:
    """mean, sample sd (None below two values), min and max."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values)}


def steps_ratios(runs: Sequence[dict], target_pct: float = 2.0) -> list[dict]:
    """Per (model, variant, wire ratio, budget): steps to uncompressed's best loss + ``target_pct`` % over
    uncompressed's, paired by seed; a run that never gets there gives a lower bound (``censored``)."""
    dense = {(r["model"], r["steps"], r["seed"]): r for r in runs if is_reference(r)}
    per = defaultdict(dict)
    for r in runs:
        ref = dense.get((r["model"], r["steps"], r["seed"]))
        if r["method"] == "none" or ref is None:
            continue
        target = at_best_validation([ref])[0]["val_loss"] * (1 + target_pct / 100)
        n_ref, n = steps_to_target(ref["val_loss_curve"], target), steps_to_target(r["val_loss_curve"], target)
        if n_ref:
            per[(r["model"], r["method"], r["variant"], ratio_key(r["method"], r["wire_ratio"])[1], r["steps"])][r["seed"]] = \
                (n / n_ref if n is not None else r["steps"] / n_ref, n is None)
    out = []
    for (model, method, variant, ratio, budget), seeds in sorted(per.items()):
        xs = [v for v, _ in seeds.values()]
        out.append({"model": model, "method": method, "variant": variant, "ratio": ratio, "budget": budget,
                    "seeds": len(xs), "per_seed": {s: v for s, (v, _) in sorted(seeds.items())}, **_spread(xs),
                    "censored": sum(c for _, c in seeds.values()), "target_pct": target_pct})
    return out


def steps_ratio_table(ratios: Sequence[dict]) -> str:
    """Markdown: one row per (variant, wire ratio), one column per budget: mean ± sd [min, max], n seeds."""
    budgets = sorted({r["budget"] for r in ratios})
    rows = defaultdict(dict)
    for r in ratios:
        rows[(r["method"], r["variant"], r["ratio"])][r["budget"]] = r
    lines = ["| method | " + " | ".join(f"{b:,} steps" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for (_, variant, ratio), cells in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        txt = []
        for b in budgets:
            c = cells.get(b)
            if c is None:
                txt.append("")
                continue
            sd = f" ± {c['sd']:.2f}" if c["sd"] is not None else ""
            txt.append(f"{'>' if c['censored'] else ''}{c['mean']:.2f}{sd} [{c['min']:.2f}, {c['max']:.2f}], n={c['seeds']}"
                       + (f" ({c['censored']} censored)" if c["censored"] else ""))
        lines.append(f"| {label((variant, ratio))} | " + " | ".join(txt) + " |")
    return "\n".join(lines) + "\n"


def ratio_trend(runs: Sequence[dict]) -> list[dict]:
    """At each evaluation step s of the longest budget: steps to uncompressed's loss at s (same seed) over s."""
    dense = {(r["model"], r["steps"], r["seed"]): r for r in runs if is_reference(r)}
    paired = defaultdict(list)
    for r in runs:
        if r["method"] != "none" and (r["model"], r["steps"], r["seed"]) in dense:
            paired[(r["model"], r["method"], r["variant"], ratio_key(r["method"], r["wire_ratio"])[1])].append(r)
    out = []
    for (model, method, variant, ratio), rs in sorted(paired.items()):
        budget = max(r["steps"] for r in rs)
        points = defaultdict(list)
        for r in (r for r in rs if r["steps"] == budget):
            for s, loss in dense[(model, budget, r["seed"])]["val_loss_curve"]:
                n = steps_to_target(r["val_loss_curve"], loss)
                points[s].append(None if n is None else n / s)
        for s, vals in sorted(points.items()):
            got = [v for v in vals if v is not None]
            out.append({"method": method, "variant": variant, "ratio": ratio, "budget": budget, "step": s,
                        "seeds": len(vals), "reached": len(got),
                        "mean": sum(got) / len(got) if got else None, "min": min(got, default=None),
                        "max": max(got, default=None)})
    return out


def ratio_from_penalty(delta_loss: float, tokens: float, fit: str = "chinchilla") -> float:
    """Steps-to-target ratio implied by a final-loss penalty ``delta_loss`` after ``tokens``:
    (1 + delta / (B D0^-beta))^(1/beta) under L(D) = L_inf + B D^-beta, the penalty taken as lost token efficiency."""
    f = LOSS_FITS[fit]
    reducible = f["B"] * tokens ** -f["beta"]
    base = 1 + delta_loss / reducible
    return base ** (1 / f["beta"]) if base > 0 else 0.0


def paper_steps_ratios(scale: str, stages: int = 4, tokens: float | None = None) -> dict:
    """Steps ratio per method at a paper scale, from Table 1's penalties, as (low, high) over the fits."""
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
        out[e["method"]] = {"low": min(rs), "high": max(rs), "delta": delta, "ratio": e["reported_ratio"],
                            "proj_ratio": e["projection_ratio"]}
    return out


def time_to_target_rows(runs: Sequence[dict], cases: dict, bandwidths: Sequence[float], latency_s: float = 0.0,
                        target_pct: float = 2.0) -> list[dict]:
    """Time to target by the report's rule with each (method, wire ratio)'s step time on each bandwidth."""
    common = common_target(runs, target_pct)
    if common is None:
        return []
    target, rows = common[0], on_target_set(runs)
    out = []
    for key, case in cases.items():
        budget, seeds, curve = method_curve(rows, *key)
        n = steps_to_target(curve, target) if curve else None
        for bw in bandwidths:
            st = case.step_time(LinkProfile(f"{bw:g}", bw, latency_s))
            out.append({"method": key[0], "ratio": key[1], "budget": budget, "seeds": seeds, "target": target,
                        "bandwidth_bps": bw, "latency_s": latency_s, "steps_to_target": n, "step_s": st,
                        "time_s": None if n is None else n * st})
    return out


def crossover_bandwidth(time_a: Callable[[float], float], time_b: Callable[[float], float],
                        lo: float = 1e5, hi: float = 1e12, iters: int = 50) -> float:
    """Bandwidth (bit/s) where ``a`` and ``b`` swap, by bisection in log bandwidth (inf: a faster on all of
    [lo, hi]; 0.0: slower on all)."""
    def f(bw: float) -> float:
        return time_a(bw) - time_b(bw)

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
    """Crossover of a against b (``mid``) and its range over the step-time error and each side's steps."""
    def cross(ka, kb, na, nb):
        return crossover_bandwidth(lambda bw: na * ka * step_a(bw), lambda bw: nb * kb * step_b(bw), **kw)
    mid = cross(1, 1, sum(steps_a) / 2, sum(steps_b) / 2)
    ends = [cross(1 + rel_err, 1 - rel_err, steps_a[1], steps_b[0]), cross(1 - rel_err, 1 + rel_err, steps_a[0], steps_b[1])]
    return {"mid": mid, "low": min(ends + [mid]), "high": max(ends + [mid])}


def speedup_grid(cases: dict, steps: dict, bandwidths: Sequence[float], latencies: Sequence[float],
                 reference: str = "none") -> dict:
    """``{method: [[time to target of reference / method, per bandwidth] per latency]}``."""
    grid = {}
    for lat in latencies:
        links = [LinkProfile(f"{bw:g}", bw, lat) for bw in bandwidths]
        ref = [steps[reference] * cases[reference].step_time(lk) for lk in links]
        for m, case in cases.items():
            grid.setdefault(m, []).append([r / (steps[m] * case.step_time(lk)) for r, lk in zip(ref, links)])
    return grid


def validated_error(path: str | Path, min_comm: float = 0.25, default: float | None = None) -> float | None:
    """Largest |relative error| of the cost model in its validation JSON where the link is >= ``min_comm`` of a step."""
    path = Path(path)
    if not path.exists():
        return default
    cells = json.loads(path.read_text())["cells"]
    errs = [abs(c["error"]) for c in cells if c["comm_fraction"] >= min_comm and c.get("error") is not None]
    return max(errs) if errs else default


def steps_report(runs: Sequence[dict], target_pct: float = 2.0) -> str:
    """Markdown: :func:`steps_ratio_table`, then :func:`ratio_trend` along the runs longer than the shortest."""
    ratios = steps_ratios(runs, target_pct)
    if not ratios:
        return "No run has an uncompressed run of the same budget and seed to compare with.\n"
    text = (f"Steps to reach uncompressed's best loss + {target_pct:g} % (same budget and seed), relative to "
            f"uncompressed's: mean ± sd over seeds [min, max]; '>': a lower bound (a seed never got there).\n\n"
            + steps_ratio_table(ratios))
    shortest = min(r["budget"] for r in ratios)
    lines = defaultdict(list)
    for t in ratio_trend(runs):
        if t["budget"] > shortest:
            got = "never" if t["mean"] is None else f"{t['mean']:.2f}" + ("" if t["reached"] == t["seeds"] else
                                                                           f" ({t['reached']}/{t['seeds']} seeds)")
            lines[(label((t["variant"], t["ratio"])), t["budget"])].append(f"{t['step']:,}: {got}")
    if lines:
        text += ("\nAlong the longest runs: steps to reach uncompressed's loss at step s (same seed), divided by s, "
                 "mean over seeds:\n\n" + "\n".join(f"* {name} ({budget:,} steps): " + ", ".join(cells)
                                                   for (name, budget), cells in lines.items()) + "\n")
    return text

