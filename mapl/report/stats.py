"""Δ% against the uncompressed run, summaries over seeds, paired comparisons, t intervals and exact tests (no scipy)."""
from __future__ import annotations

import math
import statistics
from typing import Sequence

from .rows import KEY, group_runs, is_reference

__all__ = ["delta_pct", "reference_loss", "summarize",
 "t_quantile", "t_interval", "paired", "t_test_p",
           "wilcoxon_p", "sign_test_p", "holm", "spread"]


def delta_pct(loss: float | None, ref: float | None) -> float | None:
    """100 (loss - ref) / ref; None when either is missing."""
    if loss is None or ref is None or not ref:
        return None
    return 100.0 * (loss - ref) / ref


def reference_loss(rows: Sequence[dict], r: dict) -> float | None:
    """The uncompressed loss for ``r`` (the rule: docs/report.md)."""
    def plain(x: dict) -> bool:
        return (is_reference(x) and x["steps"] == r["steps"]
                and x["profile"] == r["profile"] and x.get("val_loss") is not None
                and x.get("data_source", "") == r.get("data_source", "")
                and (x.get("eval_offset") or 0) == (r.get("eval_offset") or 0))
    refs = [x for x in rows if plain(x) and x["model"] == r["model"]]
    if not refs and r.get("base_model") and r["model"] != r["base_model"]:
        refs = [x for x in rows if plain(x) and x["model"] == r["base_model"]]
    for pool in ([x for x in refs if x["stages"] == r["stages"]], refs):
        same = [x["val_loss"] for x in pool if x["seed"] == r["seed"]]
        if same:
            return same[0]
        if pool:
            return statistics.fmean(x["val_loss"] for x in pool)
    return None


def spread(values: Sequence[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def summarize(rows: Sequence[dict], within: Sequence[dict] | None = None) -> list[dict]:
    """One summary per configuration (run_key without the seed): n, seeds, the loss's mean, std, min, max, Δ%'s
    mean and std, ``deltas`` (seed -> Δ%; references looked up in ``within``, default ``rows``)."""
    within = rows if within is None else within
    out = []
    for runs in group_runs(rows).values():
        losses = [x["val_loss"] for x in runs]
        deltas = {r["seed"]: d for r in runs if (d := delta_pct(r["val_loss"], reference_loss(within, r))) is not None}
        first = runs[0]
        keep = ("variant", "projection_ratio", "d_model", "base_model", "profile", "fwd_bytes_per_token",
                "bwd_bytes_per_token", "total_bytes_per_token", "state_bytes_per_token", "sync_bytes_per_token",
                "tokens", "n_params")
        out.append({**{k: first.get(k) for k in KEY[:-1]}, **{k: first.get(k) for k in keep},
                    "n": len(runs), "seeds": sorted(x["seed"] for x in runs),
                    "val_loss": statistics.fmean(losses), "val_loss_std": spread(losses),
                    "val_loss_min": min(losses), "val_loss_max": max(losses),
                    "delta_pct": statistics.fmean(deltas.values()) if deltas else None,
                    "delta_std": spread(list(deltas.values())), "deltas": deltas,
                    "runs": [x["run"] for x in runs]})
    return out


def _t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer ``df``, in closed form (Abramowitz & Stegun 26.7.3/4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:                                 # odd: 2/pi (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ...))
        term, acc = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= 2 * k / (2 * k + 1) * c2
            acc += term
        a = 2 / math.pi * (theta + s * math.cos(theta) * acc)
    else:                                      # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...)
        term, acc = 1.0, 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            acc += term
        a = s * acc
    return 0.5 * (1.0 + a)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` >= 1 (bisection on the CDF)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile: p={p!r} must be in (0, 1) and df={df!r} >= 1")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Two-sided t interval of the mean of ``values`` (None for fewer than two)."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def paired(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> dict | None:
    """a[seed] - b[seed] over the seeds both have (None without one): seeds, diffs, n, mean, std, ci, level."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    diffs = [a[s] - b[s] for s in seeds]
    return {"seeds": seeds, "diffs": diffs, "n": len(diffs), "mean": statistics.fmean(diffs),
            "std": spread(diffs), "ci": t_interval(diffs, level), "level": level}


# ---- exact tests of a paired difference ---------------------------------------------------------------------
def t_test_p(values: Sequence[float]) -> float | None:
    """Two-sided p of the one-sample t test of mean 0 (None for fewer than two values)."""
    n = len(values)
    if n < 2:
        return None
    sd = statistics.stdev(values)
    mean = statistics.fmean(values)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (sd / math.sqrt(n))
    return 2.0 * (1.0 - _t_cdf(t, n - 1))


def wilcoxon_p(values: Sequence[float]) -> float | None:
    """Two-sided p of the exact Wilcoxon signed-rank test (zeros dropped, mid-ranks, n <= 20)."""
    nonzero = [v for v in values if v != 0]
    n = len(nonzero)
    if n == 0 or n > 20:
        return None
    order = sorted(range(n), key=lambda i: abs(nonzero[i]))
    ranks = [0.0] * n
    i = 0
    while i < n:                                   # mid-ranks for ties
        j = i
        while j + 1 < n and abs(nonzero[order[j + 1]]) == abs(nonzero[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    w_plus = sum(r for r, v in zip(ranks, nonzero) if v > 0)
    centre = sum(ranks) / 2
    extreme = abs(w_plus - centre)
    hits = 0
    for mask in range(1 << n):
        w = sum(ranks[k] for k in range(n) if mask >> k & 1)
        hits += abs(w - centre) >= extreme - 1e-12
    return hits / (1 << n)


def sign_test_p(values: Sequence[float]) -> float | None:
    """Two-sided p of the exact sign test (zeros dropped); None without a nonzero value."""
    nonzero = [v for v in values if v != 0]
    n = len(nonzero)
    if n == 0:
        return None
    k = min(sum(v > 0 for v in nonzero), sum(v < 0 for v in nonzero))
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def holm(pvalues: Sequence[float | None], alpha: float = 0.05) -> list[dict]:
    """Holm's step-down procedure (docs/protocol.md): per test ``p_adj``, ``rejected`` and its interval's ``level``;
    a None p stays None and is not counted."""
    ranked = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(ranked)
    out: list[dict] = [{"p_adj": None, "level": None, "rejected": None} for _ in pvalues]
    running, stepping = 0.0, True
    for k, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (m - k) * p))
        stepping = stepping and p <= alpha / (m - k)
        out[i] = {"p_adj": running, "level": 1 - alpha / (m - k) if stepping else 1 - alpha / m,
                  "rejected": stepping}
    return out
