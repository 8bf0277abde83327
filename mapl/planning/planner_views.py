"""The planner notebook's cases (measured, or a paper shape on a public GPU spec), summaries and figures."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Sequence

from ..core.config import load_run_config
from ..core.link import LinkProfile
from ..orchestration.groups import group_specs
from ..report.figures import new_figure
from ..report.render import save_figure
from ..report.rows import at_projection_ratio
from ..report.studies.headline import headline_ratio
from ..report.style import NEUTRAL, SPEEDUP_CMAP
from ..report.style import label as style_label
from ..report.style import style as method_kw
from .costmodel import (PLANNER_MICRO_BATCH_FACTORS, PLANNER_SCHEDULES, boundary_bytes, build_case, measured_compute,
                        wire_ratio, with_schedule_variants)
from .planner import (common_target, crossover_interval, label, load_runs, main_model_runs, paper_steps_ratios,
                      ratio_key, speedup_grid, steps_ratios, time_to_target_rows)

__all__ = ["MEASURED_VARIANTS", "measured_sources", "pick_measured", "measured_steps", "measured_text", "bench_profile",
           "bench_cases", "flop_cases", "run_ratios", "profile_steps", "target_text", "paper_cases", "paper_steps",
           "bandwidth_grid", "plan", "bandwidth_text", "crossover_table", "crossover_summary", "crossover_takeaway",
           "label", "display_name", "method_style", "heatmap_figure", "curve_figure"]


def _bench_config(profile: str, entry: dict):
    """The profile's config whose declared bytes equal a benchmark entry's metered bytes."""
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
    """(method, ratio) -> Case with the compute measured by benchmarks/pipeline.py, the bytes declared."""
    out = {}
    for e in json.loads(Path(bench_json).read_text())["methods"]:
        cfg = _bench_config(profile, e)
        compute = measured_compute(e["timing"], f"measured by benchmarks/pipeline.py ({profile})")
        out[ratio_key(e["method"], e["ratio"])] = build_case(cfg, compute, vocab_size=cfg.data.vocab_size)
    return out


def flop_cases(profile: str, methods: dict, gpu) -> dict:
    """(method, wire ratio) -> Case of ``profile`` with FLOP-based compute on ``gpu`` (``methods``: method -> ratio)."""
    out = {}
    for m, r in methods.items():
        cfg = load_run_config(profile, {"method": m, "ratio": r})
        cfg = cfg.validate(cfg.data.vocab_size)
        out[ratio_key(m, wire_ratio(cfg, cfg.data.vocab_size))] = build_case(cfg, gpu=gpu, vocab_size=cfg.data.vocab_size)
    return out


def run_ratios(runs: Sequence[dict], methods: Sequence[str], given: dict | None = None,
               fallback: float = 8.0) -> dict:
    """method -> projection ratio: ``given``, else the most common of its longest runs, else ``fallback``."""
    out = {}
    for m in methods:
        mine = [r for r in runs if r["method"] == m and r.get("projection_ratio")]
        longest = max((r["steps"] for r in mine), default=0)
        counts = Counter(r["projection_ratio"] for r in mine if r["steps"] == longest)
        out[m] = None if m in ("none", "int8") else (given or {}).get(m) or (
            min(counts, key=lambda x: (-counts[x], x)) if counts else fallback)
    return out


def profile_steps(runs: Sequence[dict], cases: dict, target_pct: float) -> dict:
    """(method, ratio) -> (n, n) steps to the common target, None if never; without any run, one step each."""
    if not runs:
        return {k: (1.0, 1.0) for k in cases}
    rows = time_to_target_rows(runs, cases, [1e9], 0.0, target_pct)
    got = {ratio_key(r["method"], r["ratio"]): r["steps_to_target"] for r in rows}
    return {k: None if got.get(k) is None else (got[k], got[k]) for k in cases}


def target_text(runs: Sequence[dict], cases: dict, target_pct: float) -> str:
    """The common target and, per case, the steps to it and the runs they come from (or why there are none)."""
    common = common_target(runs, target_pct)
    if common is None:
        return "No uncompressed run: no target, steps to target taken as equal (time to target is the step time).\n"
    target, budget, seeds = common
    lines = [f"Target: validation loss {target:.4f} = uncompressed's best validation loss (at the step chosen on "
             f"the selection set) in its {budget:,}-step runs (mean of {seeds} seed(s)) + {target_pct:g} %, the "
             f"report's time-to-target rule. Steps to it on each method's mean curve over the seeds of its longest runs:"]
    for t in time_to_target_rows(runs, cases, [1e9], 0.0, target_pct):
        name = label((t["method"], t["ratio"]))
        if t["budget"] is None:
            lines.append(f"* {name}: no run of this configuration on the target's validation set")
        elif t["steps_to_target"] is None:
            lines.append(f"* {name}: never within {t['budget']:,} steps ({t['seeds']} seed(s))")
        else:
            lines.append(f"* {name}: {t['steps_to_target']:,.0f} steps (runs of {t['budget']:,} steps, {t['seeds']} seed(s))")
    return "\n".join(lines) + "\n"


def _paper_budget(model: str) -> int:
    """The paper profile's step budget for ``model`` (20 tokens per parameter)."""
    return next(s["train.steps"] for s in group_specs("paper", "main") if s.get("model") == model)


def paper_steps(model: str, stages: int, keys: Sequence[tuple], steps: int | None = None) -> dict:
    """(method, ratio) -> (low, high) steps at a paper scale from Table 1's penalty through the loss-vs-tokens fits."""
    steps = _paper_budget(model) if steps is None else steps
    ratios = paper_steps_ratios(model, stages)
    return {k: (steps * ratios[k[0]]["low"], steps * ratios[k[0]]["high"]) for k in keys}


# The variants that stand for a method in the measured steps, preferred first: MAPL+RVQ's long runs carry the
# per-token scale (its default configuration was trained only at 300 steps).
MEASURED_VARIANTS = {"mapl-rvq": ("mapl-rvq-scaled", "mapl-rvq")}


def measured_sources(keys: Sequence[tuple], results_dir: str | Path, target_pct: float = 2.0) -> dict:
    """(method, ratio) -> the steps_ratios row that stands for the method, at the headline's projection ratio."""
    runs = main_model_runs(load_runs(results_dir, variants=True)) if Path(results_dir).is_dir() else []
    return pick_measured(steps_ratios(at_projection_ratio(runs, headline_ratio(runs)), target_pct), keys)


def pick_measured(ratios: Sequence[dict], keys: Sequence[tuple]) -> dict:
    """Per key, the method's row of the longest budget, then the preferred variant, then the most seeds."""
    out = {}
    for key in keys:
        allowed = MEASURED_VARIANTS.get(key[0], (key[0],))
        mine = [r for r in ratios if r["method"] == key[0] and r["variant"] in allowed]
        if key[0] != "none" and mine:
            out[key] = max(mine, key=lambda r: (r["budget"], -allowed.index(r["variant"]), r["seeds"]))
    return out


def measured_steps(model: str, keys: Sequence[tuple], results_dir: str | Path, target_pct: float = 2.0,
                   steps: int | None = None) -> dict:
    """(method, ratio) -> (low, high) steps at a paper scale: our measured ratios (over seeds) x the paper budget."""
    steps = _paper_budget(model) if steps is None else steps
    src = measured_sources(keys, results_dir, target_pct)
    return {key: (steps, steps) if key[0] == "none" else (steps * src[key]["min"], steps * src[key]["max"])
            for key in keys if key[0] == "none" or key in src}


def measured_text(keys: Sequence[tuple], results_dir: str | Path, target_pct: float = 2.0) -> str:
    """One line per method: the measured steps-to-target range and the runs it comes from."""
    src = measured_sources(keys, results_dir, target_pct)
    return "; ".join(f"{label(k)} {r['min']:.2f}-{r['max']:.2f} ({r['variant']}, {r['budget']:,} steps, "
                     f"{r['seeds']} seeds, {r['censored']} censored)" for k, r in src.items())


def paper_cases(model: str, methods: Sequence[str], stages: int, micro_batches: int, micro_batch_size: int,
                seq_len: int, gpu, ratios: dict | None = None, model_overrides: dict | None = None,
                schedules: Sequence[str] = PLANNER_SCHEDULES, overrides: dict | None = None,
                micro_batch_factors: Sequence[int] = PLANNER_MICRO_BATCH_FACTORS) -> dict:
    """(method, wire ratio) -> Case of the paper profile at ``model``: FLOP-based compute on ``gpu``, 1F1B and each
    schedule variant that fits its memory (``schedules=()``: 1F1B only)."""
    paper = paper_steps_ratios(model, stages)
    out = {}
    for m in methods:
        over = {"model": model, "method": m, "stages": stages, "train.micro_batches": micro_batches,
                "train.batch_size": micro_batches * micro_batch_size, "train.seq_len": seq_len,
                "train.schedule": "1f1b", **{f"model.{k}": v for k, v in (model_overrides or {}).items()},
                **(overrides or {})}
        if m != "none":
            over["ratio"] = (ratios or {}).get(m) or paper[m]["proj_ratio"]
        cfg = load_run_config("paper", over)
        case = build_case(cfg, gpu=gpu, vocab_size=cfg.data.vocab_size)
        if schedules:
            case = with_schedule_variants(case, cfg, gpu, cfg.data.vocab_size, schedules, micro_batch_factors)
        out[ratio_key(m, wire_ratio(cfg, cfg.data.vocab_size))] = case
    return out


def bandwidth_grid(bandwidths: Sequence[float], points: Sequence[float] = (), margin: float = 3.0) -> list[float]:
    """``bandwidths`` extended on their 1-3-10 ladder to span every finite nonzero of ``points`` with ``margin``."""
    grid = sorted(set(float(b) for b in bandwidths))
    pts = [x for x in points if x and math.isfinite(x)]
    if not grid or not pts:
        return grid

    def ladder(x: float, up: bool) -> float:          # the next 1-3-10 value above / below x
        e = math.floor(math.log10(x) + 1e-9)
        steps = [m * 10.0 ** k for k in (e - 1, e, e + 1) for m in (1, 3)]
        return min(v for v in steps if v > x * (1 + 1e-9)) if up else max(v for v in steps if v < x * (1 - 1e-9))
    while grid[0] > min(pts) / margin:
        grid.insert(0, ladder(grid[0], up=False))
    while grid[-1] < max(pts) * margin:
        grid.append(ladder(grid[-1], up=True))
    return grid


def plan(cases: dict, steps: dict, bandwidths: Sequence[float], latencies: Sequence[float], latency_s: float,
         rel_err: float, reference: str = "none", rival: str | None = "ssn",
         compute_scales: Sequence[float] = (), fit_grid: bool = True) -> dict:
    """Everything the notebook shows for one model from ``cases`` and ``steps`` (method -> (low, high) or None)."""
    ok = {m: c for m, c in cases.items() if steps.get(m) is not None}
    mid = {m: sum(steps[m]) / 2 for m in ok}
    cross = {}
    for m in ok:
        for other in (reference, rival) if m != reference else ():
            if other and other != m and other in ok:
                cross[(m, other)] = _crossover(ok[m], steps[m], ok[other], steps[other], latency_s, rel_err,
                                               compute_scales)
    if fit_grid:
        bandwidths = bandwidth_grid(bandwidths, [x for c in cross.values() for x in (c["low"], c["mid"], c["high"])])
    bandwidths = list(bandwidths)
    grid = speedup_grid(ok, mid, bandwidths, latencies, reference) if reference in ok else {}
    curves = {}
    for m in ok:
        st = [ok[m].step_time(LinkProfile(f"{bw:g}", bw, latency_s)) for bw in bandwidths]
        curves[m] = ([steps[m][0] * x for x in st], [mid[m] * x for x in st], [steps[m][1] * x for x in st])
    empty = {}
    if reference not in ok:
        why = (f"{reference} has no case" if reference not in cases else f"{reference} never reaches the target")
        empty["heatmap"] = empty["crossovers"] = f"no speedup against {reference}: {why}"
    elif len(ok) == 1:
        empty["heatmap"] = empty["crossovers"] = "no compressed method reaches the target"
    if not ok:
        empty["curve"] = "no method reaches the target"
    return {"grid": grid, "curves": curves, "crossovers": cross, "never": sorted(set(cases) - set(ok)),
            "steps": {m: steps[m] for m in ok}, "latency_s": latency_s, "rel_err": rel_err,
            "compute_scales": list(compute_scales), "bandwidths": bandwidths, "latencies": list(latencies),
            "reference": reference, "empty": empty}


def _crossover(a, steps_a, b, steps_b, latency_s: float, rel_err: float, scales: Sequence[float]) -> dict:

    def step(case):
        return lambda bw: case.step_time(LinkProfile(f"{bw:g}", bw, latency_s))
    res = crossover_interval(step(a), steps_a, step(b), steps_b, rel_err, lo=1e5, hi=1e12)
    for k in scales:
        other = crossover_interval(step(a.scaled(k)), steps_a, step(b.scaled(k)), steps_b, rel_err, lo=1e5, hi=1e12)
        res["low"], res["high"] = min(res["low"], other["low"]), max(res["high"], other["high"])
    return res


def bandwidth_text(bps: float) -> str:
    """'every bandwidth' (inf), 'none' (0), else 3 significant digits in kbit/s to Tbit/s."""
    if bps == math.inf:
        return "every bandwidth"
    if not bps:
        return "none"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps / 1e3:.3g} kbit/s"


def _range_text(c: dict) -> str:
    lo, hi = bandwidth_text(c["low"]), bandwidth_text(c["high"])
    return lo if lo == hi else f"{lo} – {hi}"


def crossover_table(res: dict) -> str:
    """Markdown: below which bandwidth each method reaches the target sooner than the other, with its range."""
    if not res["crossovers"]:
        lines = [f"No crossover to show: {res['empty'].get('crossovers', 'no pair of methods to compare')}."]
    else:
        lines = [f"Crossover bandwidth at {1000 * res['latency_s']:g} ms latency: below it the method reaches the "
                 f"target first ('every bandwidth': faster from 0.1 Mbit/s to 1 Tbit/s; 'none': never); range: "
                 f"step-time error ±{100 * res['rel_err']:.0f}% and the steps-to-target range"
                 + (f", and compute x {', '.join(f'{k:.2g}' for k in res['compute_scales'])}." if res["compute_scales"]
                    else "."), "", "| method | against | crossover | range |", "|---|---|---|---|"]
        for (m, other), c in res["crossovers"].items():
            lines.append(f"| {m} | {other} | {bandwidth_text(c['mid'])} | {_range_text(c)} |")
    if res["never"]:
        lines += ["", "No steps to the target (never within their runs, or no run on the target's validation set: "
                  "the target's lines say which): " + ", ".join(map(str, res["never"])) + "."]
    return "\n".join(lines) + "\n"


def crossover_summary(res: dict, model: str = "") -> list[dict]:
    """The crossovers as CSV rows: model, method, against, latency, crossover and its range in bit/s."""
    return [{"model": model, "method": m, "against": other, "latency_ms": 1000 * res["latency_s"],
             "crossover_bps": c["mid"], "low_bps": c["low"], "high_bps": c["high"]}
            for (m, other), c in res["crossovers"].items()]


def crossover_takeaway(results: Sequence[tuple[str, dict]]) -> str:
    """The notebook's closing line: per view, below which bandwidth each method beats uncompressed to the target."""
    sentences = []
    for group, res in results:
        against = [(m, c) for (m, other), c in res["crossovers"].items() if other == "none"]
        parts = [f"{display_name(m)} below {bandwidth_text(c['mid'])} ({_range_text(c)})" for m, c in against]
        head = f"{group}: " if group else ""
        if parts:
            sentences.append(f"{head}first to the target at {1000 * res['latency_s']:g} ms latency: " + "; ".join(parts))
        else:
            sentences.append(f"{head}no method reaches the target before uncompressed on any link shown")
        if res["never"]:
            sentences[-1] += f" (never within their runs: {', '.join(map(str, res['never']))})"
    return "Takeaway: " + ". ".join(sentences) + "."


def display_name(name: str) -> str:
    """The report's display name of a plan's method name (:func:`label`): 'MAPL 8×' for 'mapl 8x'."""
    method, _, ratio = name.partition(" ")
    return style_label(method, float(ratio.rstrip("x")) if ratio else None)


def method_style(name: str) -> dict:
    """The report's colour and marker of a plan's method name."""
    return method_kw(name.partition(" ")[0])


def _headline(what: str, title: str, fig) -> str:
    """``what`` over the caller's ``title``, each line wrapped to the figure's width."""
    import textwrap
    chars = int(fig.get_figwidth() * 12)              # characters of a 10-point title per inch, with a margin
    lines = [what] + [part for line in title.splitlines() for part in textwrap.wrap(line, chars)]
    return "\n".join(lines)


def heatmap_figure(grid: dict, bandwidths: Sequence[float], latencies: Sequence[float], title: str = "",
                   reference: str = "none", path: str | Path | None = None):
    """Speedup of time to target over ``reference`` per bandwidth x latency, a panel per method (or None)."""
    import numpy as np
    from matplotlib.colors import LogNorm
    methods = [m for m in grid if m != reference]
    if not methods:
        return None
    fig, axes = new_figure(len(methods), max(3.0, 5.0 / len(methods)), 3.4)
    x, y = np.array(bandwidths) / 1e6, np.array(latencies) * 1e3
    # the colour scale from the data, symmetric about 1 in log: between x1.25 and x100 either way
    logs = [np.abs(np.log10(np.array(grid[m], dtype=float))) for m in methods]
    spread = max((float(v[np.isfinite(v)].max()) for v in logs if np.isfinite(v).any()), default=0.0)
    vmax = 10 ** min(2.0, max(math.log10(1.25), spread))
    for ax, m in zip(axes, methods):
        z = np.array(grid[m])
        im = ax.pcolormesh(x, y, z, norm=LogNorm(vmin=1 / vmax, vmax=vmax), cmap=SPEEDUP_CMAP, shading="nearest")
        if z.min() < 1 < z.max() and min(z.shape) >= 2:          # contour needs a 2 x 2 grid
            ax.contour(x, y, z, levels=[1.0], colors=NEUTRAL["contour"], linewidths=1.5)
        ax.set_xscale("log"), ax.set_xlabel("link bandwidth (Mbit/s, log)")
        if ax is axes[0]:
            ax.set_ylabel("one-way latency (ms)")
        ax.set_title(display_name(m), color=method_style(m)["color"])
    ladder = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2, 5, 10, 20, 50, 100) if vmax >= 4 else (0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2)
    ticks = [t for t in ladder if 1 / vmax <= t <= vmax]
    bar = fig.colorbar(im, ax=axes, shrink=0.85, ticks=ticks)
    bar.ax.minorticks_off()
    bar.ax.set_yticklabels([f"{t:g}×" for t in ticks], fontsize=8)
    bar.set_label(f"speedup over {display_name(reference)}\n(> 1: faster; {NEUTRAL['contour']} line: 1)", fontsize=8)
    fig.suptitle(_headline(f"Speedup of time to target over {display_name(reference)}", title, fig), fontsize=10)
    if path:
        save_figure(fig, path)
    return fig


def curve_figure(curves: dict, bandwidths: Sequence[float], rel_err: float, crossovers: dict | None = None,
                 title: str = "", path: str | Path | None = None):
    """Time to target against bandwidth per method (``curves[m] = (low, mid, high)`` s), or None without a curve."""
    if not curves:
        return None
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    fig, (ax,) = new_figure(1, 6.4, 4.2)
    x = [b / 1e6 for b in bandwidths]
    largest = max(max(hi) for _, _, hi in curves.values())
    unit, scale = next((u, k) for u, k in (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3))
                       if largest >= 3 * k or u == "ms")
    crossed = False
    for m, (lo, mid, hi) in curves.items():
        colour = method_style(m)["color"]
        ax.plot(x, [v / scale for v in mid], color=colour, lw=1.4, label=display_name(m))
        ax.fill_between(x, [v * (1 - rel_err) / scale for v in lo], [v * (1 + rel_err) / scale for v in hi],
                        color=colour, alpha=0.2, lw=0)
        for bw in (crossovers or {}).get(m, []):
            if bw:
                ax.axvline(bw / 1e6, color=colour, ls=":", lw=1)
                crossed = True
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s, log)"), ax.set_ylabel(f"time to target ({unit}, log)"), ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles.append(Patch(color=NEUTRAL["fill"], alpha=0.3, lw=0))
    labels.append(f"band: steps-to-target range, step time ±{100 * rel_err:.0f} %")
    if crossed:
        handles.append(Line2D([], [], color=NEUTRAL["guide"], ls=":", lw=1))
        labels.append("crossover against uncompressed")
    ax.legend(handles, labels, fontsize=7, loc="best")
    ax.set_title(_headline("Time to target against link bandwidth", title, fig), fontsize=10)
    if path:
        save_figure(fig, path)
    return fig
