"""The planner notebook's cases, summaries and figures (notebooks/when_it_pays.ipynb).

Two kinds of case: our measured profile (:func:`bench_cases`: compute measured by
``benchmarks/pipeline.py``, bytes declared by the profile's compressors and checked equal to the metered
ones) and a paper shape on a public GPU spec (:func:`paper_cases`: FLOP-based compute). :func:`plan`
turns cases and steps to target into the speedup grid, time-to-target curves with their band and the
crossover bandwidths; :func:`crossover_table` and the figures present them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from .planner import crossover_interval, paper_steps_ratios, ratio_key, speedup_grid

__all__ = ["bench_profile", "bench_cases", "flop_cases", "profile_steps", "paper_cases", "paper_steps", "plan", "crossover_table",
           "label", "heatmap_figure", "curve_figure"]


def _bench_config(profile: str, entry: dict):
    """The profile's config whose compressor-declared bytes equal a benchmark entry's metered bytes (the
    entry records the effective wire ratio, not the projection ratio; matching the bytes checks both)."""
    from .config import load_run_config
    from .costmodel import boundary_bytes
    tm = entry["timing"]
    metered = [(tm["fwd_bytes"][p], tm["bwd_bytes"][p], tm["state_fwd_bytes"][p], tm["state_bwd_bytes"][p])
               for p in range(len(tm["fwd_bytes"]))]
    ratios = [None] if entry["method"] in ("none", "int8") else [2, 4, 8, 16, 32, 64]
    for r in ratios:
        cfg = load_run_config(profile, {"method": entry["method"], "ratio": r, "train.schedule": tm["schedule"]})
        cfg = cfg.validate(cfg.data.vocab_size)
        if [(b.fwd, b.bwd, b.state_fwd, b.state_bwd) for b in boundary_bytes(cfg, cfg.data.vocab_size)] == metered:
            return cfg
    raise ValueError(f"benchmark entry {entry.get('run', entry['method'])!r}: no ratio of profile {profile!r} "
                     f"declares its metered bytes {metered[0]}")


def bench_profile(bench_json: str | Path) -> str | None:
    """The profile a pipeline benchmark measured (None if the file does not exist)."""
    path = Path(bench_json)
    return json.loads(path.read_text()).get("profile") if path.exists() else None


def bench_cases(bench_json: str | Path, profile: str = "cpu") -> dict:
    """(method, ratio) -> Case with the compute measured by benchmarks/pipeline.py and the bytes declared by
    the profile's compressors (checked equal to the metered bytes)."""
    from .costmodel import build_case, measured_compute
    data = json.loads(Path(bench_json).read_text())
    out = {}
    for e in data["methods"]:
        cfg = _bench_config(profile, e)
        out[ratio_key(e["method"], e["ratio"])] = build_case(
            cfg, measured_compute(e["timing"], f"measured by benchmarks/pipeline.py ({profile})"),
            vocab_size=cfg.data.vocab_size)
    return out


def label(key) -> str:
    """'mapl 8x' for ('mapl', 8.0); 'none' for the uncompressed run."""
    m, r = key if isinstance(key, tuple) else (key, 1.0)
    return m if m == "none" else f"{m} {r:g}x"


def flop_cases(profile: str, methods: dict, gpu) -> dict:
    """(method, wire ratio) -> Case of ``profile``'s configs with FLOP-based compute on ``gpu`` (for a
    profile that has no step measurement); ``methods``: method -> projection ratio (None: none/int8)."""
    from .config import load_run_config
    from .costmodel import build_case, wire_ratio
    out = {}
    for m, r in methods.items():
        cfg = load_run_config(profile, {"method": m, "ratio": r})
        cfg = cfg.validate(cfg.data.vocab_size)
        out[ratio_key(m, wire_ratio(cfg, cfg.data.vocab_size))] = build_case(cfg, gpu=gpu, vocab_size=cfg.data.vocab_size)
    return out


def profile_steps(runs: Sequence[dict], cases: dict, target_pct: float) -> dict:
    """(method, ratio) -> (n, n) steps to the common target (the measured table's rule), None if never.
    Without runs every method gets one step: time to target is then the step time."""
    from .planner import time_to_target_rows
    if not runs:
        return {k: (1.0, 1.0) for k in cases}
    rows = time_to_target_rows(runs, cases, [1e9], 0.0, target_pct)
    got = {ratio_key(r["method"], r["ratio"]): r["steps_to_target"] for r in rows}
    return {k: None if got.get(k) is None else (got[k], got[k]) for k in cases}


def paper_steps(model: str, stages: int, keys: Sequence[tuple], steps: int | None = None) -> dict:
    """(method, ratio) -> (low, high) steps to uncompressed's final loss at a paper scale (Table 1's
    penalty of the method through the loss-vs-tokens fits), for the profile's step budget of that model."""
    from .sweep import group_specs
    if steps is None:           # the paper profile's budget for this model (20 tokens per parameter)
        steps = next(s["train.steps"] for s in group_specs("paper", "main") if s.get("model") == model)
    ratios = paper_steps_ratios(model, stages)
    return {k: (steps * ratios[k[0]]["low"], steps * ratios[k[0]]["high"]) for k in keys}


def paper_cases(model: str, methods: Sequence[str], stages: int, micro_batches: int, micro_batch_size: int,
                seq_len: int, gpu, ratios: dict | None = None, model_overrides: dict | None = None) -> dict:
    """(method, wire ratio) -> Case of the paper profile at ``model`` (+ ``model_overrides``) with the paper's
    ratio for that scale (or ``ratios[method]``), FLOP-based compute on ``gpu`` and 1F1B (GPipe does not fit:
    mapl.memory)."""
    from .config import load_run_config
    from .costmodel import build_case, wire_ratio
    paper = paper_steps_ratios(model, stages)
    out = {}
    for m in methods:
        over = {"model": model, "method": m, "stages": stages, "train.micro_batches": micro_batches,
                "train.batch_size": micro_batches * micro_batch_size, "train.seq_len": seq_len,
                "train.schedule": "1f1b", **{f"model.{k}": v for k, v in (model_overrides or {}).items()}}
        if m != "none":
            over["ratio"] = (ratios or {}).get(m) or paper[m]["proj_ratio"]
        cfg = load_run_config("paper", over)
        out[ratio_key(m, wire_ratio(cfg, cfg.data.vocab_size))] = build_case(cfg, gpu=gpu, vocab_size=cfg.data.vocab_size)
    return out


def plan(cases: dict, steps: dict, bandwidths: Sequence[float], latencies: Sequence[float], latency_s: float,
         rel_err: float, reference: str = "none", rival: str | None = "ssn",
         compute_scales: Sequence[float] = ()) -> dict:
    """Everything the notebook shows for one model: ``cases`` method -> Case, ``steps`` method -> (low, high)
    steps to target (None: never reaches it). Methods that never reach the target are left out of the
    grid and curves and listed in ``never``. ``compute_scales``: other compute estimates (every compute
    time x k, e.g. another MFU) whose crossovers widen the range."""
    from .link import LinkProfile
    ok = {m: c for m, c in cases.items() if steps.get(m) is not None}
    mid = {m: sum(steps[m]) / 2 for m in ok}
    grid = speedup_grid(ok, mid, bandwidths, latencies, reference) if reference in ok else {}
    curves = {}
    for m in ok:
        st = [ok[m].step_time(LinkProfile(f"{bw:g}", bw, latency_s)) for bw in bandwidths]
        curves[m] = ([steps[m][0] * x for x in st], [mid[m] * x for x in st], [steps[m][1] * x for x in st])
    cross = {}
    for m in ok:
        for other in (reference, rival) if m != reference else ():
            if other and other != m and other in ok:
                cross[(m, other)] = _crossover(ok[m], steps[m], ok[other], steps[other], latency_s, rel_err,
                                               compute_scales)
    return {"grid": grid, "curves": curves, "crossovers": cross, "never": sorted(set(cases) - set(ok)),
            "steps": {m: steps[m] for m in ok}, "latency_s": latency_s, "rel_err": rel_err,
            "compute_scales": list(compute_scales)}


def _crossover(a, steps_a, b, steps_b, latency_s: float, rel_err: float, scales: Sequence[float]) -> dict:
    from .link import LinkProfile

    def step(case):
        return lambda bw: case.step_time(LinkProfile(f"{bw:g}", bw, latency_s))
    res = crossover_interval(step(a), steps_a, step(b), steps_b, rel_err, lo=1e5, hi=1e12)
    for k in scales:
        other = crossover_interval(step(a.scaled(k)), steps_a, step(b.scaled(k)), steps_b, rel_err, lo=1e5, hi=1e12)
        res["low"], res["high"] = min(res["low"], other["low"]), max(res["high"], other["high"])
    return res


def _mbps(x) -> str:
    if x == math.inf:
        return "every bandwidth"
    return "none" if x == 0 else f"{x / 1e6:.3g}"


def crossover_table(res: dict) -> str:
    """Markdown: below which bandwidth each method reaches the target sooner than the other, with the
    range from the model's validated error and the steps range."""
    lines = [f"Crossover bandwidth (Mbit/s) at {1000 * res['latency_s']:g} ms latency: below it the method reaches "
             f"the target first ('every bandwidth': faster from 0.1 Mbit/s to 1 Tbit/s; 'none': never); range: "
             f"step-time error ±{100 * res['rel_err']:.0f}% and the steps-to-target range"
             + (f", and compute x {', '.join(f'{k:.2g}' for k in res['compute_scales'])}." if res["compute_scales"] else "."),
             "", "| method | against | crossover | range |", "|---|---|---|---|"]
    for (m, other), c in res["crossovers"].items():
        lines.append(f"| {m} | {other} | {_mbps(c['mid'])} | {_mbps(c['low'])} – {_mbps(c['high'])} |")
    if res["never"]:
        lines += ["", "Never reach the target within their runs: " + ", ".join(map(str, res["never"])) + "."]
    return "\n".join(lines) + "\n"


def _axes(n: int, width: float = 4.2, height: float = 3.4):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def heatmap_figure(grid: dict, bandwidths: Sequence[float], latencies: Sequence[float], title: str = "",
                   reference: str = "none", path: str | Path | None = None):
    """Speedup of time to target against ``reference`` over bandwidth x latency, one panel per method;
    the white contour is speedup 1 (the crossover)."""
    import numpy as np
    from matplotlib.colors import LogNorm
    methods = [m for m in grid if m != reference]
    fig, axes = _axes(len(methods))
    x, y = np.array(bandwidths) / 1e6, np.array(latencies) * 1e3
    for ax, m in zip(axes, methods):
        z = np.array(grid[m])
        im = ax.pcolormesh(x, y, z, norm=LogNorm(vmin=0.1, vmax=10), cmap="RdBu", shading="nearest")
        if z.min() < 1 < z.max():
            ax.contour(x, y, z, levels=[1.0], colors="white", linewidths=1.5)
        ax.set_xscale("log"), ax.set_xlabel("bandwidth (Mbit/s)"), ax.set_ylabel("latency (ms)")
        ax.set_title(f"{m}: speedup vs {reference}")
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(title, y=1.03)
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def curve_figure(curves: dict, bandwidths: Sequence[float], rel_err: float, crossovers: dict | None = None,
                 title: str = "", path: str | Path | None = None):
    """Time to target against bandwidth per method: ``curves[m] = (low, mid, high)`` lists of seconds
    (steps range); the band adds the cost model's validated error; vertical lines mark crossovers."""
    fig, (ax,) = _axes(1, 6.5, 4.2)
    x = [b / 1e6 for b in bandwidths]
    for m, (lo, mid, hi) in curves.items():
        line, = ax.plot(x, [v / 3600 for v in mid], label=m)
        ax.fill_between(x, [v * (1 - rel_err) / 3600 for v in lo], [v * (1 + rel_err) / 3600 for v in hi],
                        color=line.get_color(), alpha=0.2)
        for bw in (crossovers or {}).get(m, []):
            if bw:
                ax.axvline(bw / 1e6, color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("bandwidth (Mbit/s)"), ax.set_ylabel("time to target (h)"), ax.grid(alpha=0.3)
    ax.legend(fontsize=8), ax.set_title(title)
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig
