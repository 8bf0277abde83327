"""Drawing: every figure of the report on matplotlib's object API and the Agg canvas (pyplot's
global state is never touched, so the notebook's inline backend plays no part).

Every method keeps one colour and one marker everywhere (:mod:`mapl.report.style`); legends name
methods and ratios, never run ids; error bars show the std over seeds wherever there are seeds, or
the 95% t interval where the caption says so. Each function returns a :class:`Figure`; the captions
and takeaways are in :mod:`mapl.report.plots`.
"""
from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from ..base.io import atomic_write_bytes
from .rows import group_runs, sort_key
from .style import fmt_ratio, label, linestyle, style, variant_label

__all__ = ["new_figure", "save_figure", "png_bytes", "empty_note", "pareto_figure", "loss_curves_figure",
           "axis_figure", "health_figure", "gap_curves_figure", "paper_scatter_figure"]

LINESTYLES = ("-", "--", ":", "-.")


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.8) -> tuple[Figure, list]:
    """A figure of ``ncols`` panels, each ``width`` x ``height`` inches, on the Agg canvas."""
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def png_bytes(fig: Figure, dpi: int = 120) -> bytes:
    """The figure as PNG bytes, without a software tag (so equal figures give equal bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def save_figure(fig: Figure, path: str | Path | None) -> Figure:
    """Write the PNG atomically (``path`` None: nothing); returns the figure."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, png_bytes(fig))
    return fig


def empty_note(ax, text: str = "no runs") -> None:
    """Blank the axes with one line of grey text."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.35", wrap=True)
    ax.set_xticks([]), ax.set_yticks([])


def _log2_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _setup_name(variant: str, model: str, stages: int, steps: int, several_setups: bool, several_budgets: bool) -> str:
    """A line's legend entry: the method, then its model and P where there are several, and its budget where
    budgets differ (blocks' mini trains 1,000 steps beside tiny's 300)."""
    where = [f"{model}, P={stages}"] if several_setups else []
    where += [f"{steps:,} steps"] if several_budgets else []
    return variant_label(variant) + (f" ({', '.join(where)})" if where else "")


def pareto_figure(sums: Sequence[dict]) -> Figure:
    """Δ% against forward bytes (left) and total bytes (right) per token and boundary, one line per
    method (per model and P where there are several); error bars: std over seeds; each point
    labelled with its wire ratio; the title names the budget when all lines share one."""
    fig, axes = new_figure(2, 5.2, 4.0)
    lines = defaultdict(list)
    for s in sums:
        lines[(s["model"], s["stages"], s["variant"])].append(s)
    setups = sorted({(m, p) for m, p, _ in lines}, key=str)
    budgets = sorted({s["steps"] for s in sums})
    for i, ((model, stages, variant), pts) in enumerate(sorted(lines.items(), key=lambda kv: sort_key(kv[1][0]))):
        ls = LINESTYLES[setups.index((model, stages)) % len(LINESTYLES)]
        name = _setup_name(variant, model, stages, pts[0]["steps"], len(setups) > 1, len(budgets) > 1)
        for ax, xkey in zip(axes, ("fwd_bytes_per_token", "total_bytes_per_token")):
            pts_x = sorted((s for s in pts if s[xkey]), key=lambda s: -s[xkey])
            if not pts_x:
                continue
            err = [s["delta_std"] or 0.0 for s in pts_x]
            y = [0.0 if s["method"] == "none" else (s["delta_pct"] if s["delta_pct"] is not None else np.nan)
                 for s in pts_x]
            ax.errorbar([s[xkey] for s in pts_x], y, yerr=err if any(err) else None, capsize=3, ls=ls, ms=6,
                        label=name, **style(variant))
            for s, yy in zip(pts_x, y):
                ax.annotate(fmt_ratio(s["wire_ratio"]), (s[xkey], yy), fontsize=7, color=style(variant)["color"],
                            xytext=(5, 4) if i % 2 else (5, -10), textcoords="offset points")
    titles = ("forward payload only", "total: both directions, ids, projector + codebook sync")
    xlabels = ("forward bytes / token / boundary (log)", "total bytes / token / boundary (log)")
    for ax, xlabel, title in zip(axes, xlabels, titles):
        if not sums:
            empty_note(ax, "no runs in group main")
            continue
        _log2_axis(ax)
        ax.set(xlabel=xlabel, ylabel="Δ% val loss vs uncompressed", title=title)
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.grid(alpha=0.3)
    if sums and len(setups) > 1:                           # one line per method and setup: below the panels, not on the points
        fig.legend(*axes[1].get_legend_handles_labels(), fontsize=8, loc="outside lower center", ncol=3)
    elif sums:
        axes[1].legend(fontsize=8, loc="best")
    fig.suptitle("Loss against communication, token-matched" + (f" ({budgets[0]:,} steps)" if len(budgets) == 1 else ""))
    return fig


def _smooth(y: Sequence[float], k: int) -> np.ndarray:
    y = np.asarray(y, dtype=float)
    return y if k <= 1 or len(y) < k else np.convolve(y, np.ones(k) / k, mode="valid")


def _mean_curve(runs: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean, min and max over seeds of one curve, on the steps every seed has."""
    curves = [dict(r[key]) for r in runs if r[key]]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    ys = np.array([[c[s] for s in steps] for c in curves]) if steps else np.zeros((0, 0))
    if not steps:
        return (np.array([]),) * 4
    return np.array(steps), ys.mean(0), ys.min(0), ys.max(0)


def loss_curves_figure(rows: Sequence[dict], smooth: int | None = None, title: str = "") -> Figure:
    """Train loss (moving mean over ``smooth`` steps; default: 1/30 of the budget, at least 10) and
    val loss against step, one line per configuration (the mean over its seeds, the band their
    range); colour and marker by method, line style by wire ratio."""
    fig, (ax_t, ax_v) = new_figure(2, 5.2, 4.0)
    smooth = smooth or max(10, max((r["steps"] or 0 for r in rows), default=0) // 30)
    groups = group_runs(sorted(rows, key=sort_key))
    for runs in groups.values():
        r = runs[0]
        name = label(r["variant"], r["wire_ratio"], r["projection_ratio"])
        name += f", {len(runs)} seeds" if len(runs) > 1 else ""
        kw = {**style(r["variant"]), "ls": linestyle(r["wire_ratio"]), "lw": 1.2}
        steps, mean, lo, hi = _mean_curve(runs, "train_loss_curve")
        if len(steps):
            y, lo_s, hi_s = (_smooth(v, smooth) for v in (mean, lo, hi))
            x = steps[len(steps) - len(y):]
            ax_t.plot(x, y, markevery=max(1, len(x) // 6), ms=5, label=name, **kw)
            if len(runs) > 1:
                ax_t.fill_between(x, lo_s, hi_s, color=kw["color"], alpha=0.15, lw=0)
        steps, mean, lo, hi = _mean_curve(runs, "val_loss_curve")
        if len(steps):
            ax_v.plot(steps, mean, ms=5, label=name, **kw)
            if len(runs) > 1:
                ax_v.fill_between(steps, lo, hi, color=kw["color"], alpha=0.15, lw=0)
    for ax, sub in ((ax_t, f"train loss (moving mean of {smooth} steps)"), (ax_v, "validation loss")):
        if not groups:
            empty_note(ax)
            continue
        ax.set(xlabel="optimizer step", ylabel="loss", title=sub)
        ax.grid(alpha=0.3)
    if groups:
        ax_v.legend(fontsize=7, ncol=2 if len(groups) > 6 else 1)
        _zoom_to_tail(ax_t, [ln.get_ydata() for ln in ax_t.get_lines()])
    if title:
        fig.suptitle(title)
    return fig


def _zoom_to_tail(ax, ys) -> None:
    """Clip the y range to the last 90% of the curves: the first steps' loss (~ln V) hides the rest."""
    tails = [np.asarray(y)[len(y) // 10:] for y in ys if len(y) > 10]
    if tails:
        lo, hi = min(t.min() for t in tails), max(t.max() for t in tails)
        ax.set_ylim(lo - 0.02 * (hi - lo), hi + 0.05 * (hi - lo))


def _delta_series(ax, points: Sequence[dict], xkey: str, v: str, jitter: float) -> None:
    """One variant's Δ% against ``xkey``; a budget where it has no run leaves a gap in its line (NaN),
    so no line is drawn across a missing point."""
    have = [p for p in points if v in p["sums"] and p["sums"][v]["delta_pct"] is not None]
    if not have:
        return
    first, last = points.index(have[0]), points.index(have[-1])
    span = points[first:last + 1]
    ys = [p["sums"][v]["delta_pct"] if p in have else np.nan for p in span]
    err = [(p["sums"][v]["delta_std"] or 0.0) if p in have else np.nan for p in span]
    s0 = have[0]["sums"][v]
    ax.errorbar([p[xkey] * jitter for p in span], ys, yerr=err, capsize=3, ms=6,
                label=label(v, s0["wire_ratio"], s0["projection_ratio"]), **style(v))


def axis_figure(points: Sequence[dict], xkey: str, xlabel: str, variants: Sequence[str], title: str,
                empty: str, separate: Sequence[str] = ()) -> Figure:
    """Panels against ``xkey`` (log2): each variant's Δ% (mean, error bars = std over seeds; the
    variants in ``separate`` in a panel of their own, so one unstable method does not set the scale
    of the others), and the paired SSN - MAPL gap (mean; error bars = 95% t interval where there are
    2+ seeds; dots = the per-seed differences)."""
    fig, axes = new_figure(3 if separate else 2, 5.2, 3.9)
    ax_d, ax_g = axes[0], axes[-1]
    ax_s = axes[1] if separate else None
    if not points:
        for ax in axes:
            empty_note(ax, empty)
        return fig
    xs = [p[xkey] for p in points]
    for i, v in enumerate(variants):
        jitter = 1 + 0.025 * (i - (len(variants) - 1) / 2)       # side by side, so error bars do not hide
        _delta_series(ax_s if v in separate else ax_d, points, xkey, v, jitter)
    if ax_s is not None:
        if ax_s.get_lines():
            _log2_axis(ax_s)
            ax_s.set_xticks(xs)
            ax_s.set(xlabel=xlabel, ylabel="Δ% val loss vs uncompressed", title="MAPL+VQ (own scale)")
            ax_s.axhline(0.0, color="0.6", lw=0.8)
            ax_s.grid(alpha=0.3)
            ax_s.legend(fontsize=8)
        else:
            empty_note(ax_s, "no MAPL+VQ runs")
    gaps = [(p[xkey], p["gap"]) for p in points if p["gap"]]
    for x, g in gaps:
        ax_g.scatter([x] * g["n"], g["diffs"], s=14, color=style("ssn")["color"], alpha=0.45, lw=0)
    if gaps:
        mean = [g["mean"] for _, g in gaps]
        err = np.array([[g["mean"] - g["ci"][0], g["ci"][1] - g["mean"]] if g["ci"] else [0.0, 0.0] for _, g in gaps]).T
        ax_g.errorbar([x for x, _ in gaps], mean, yerr=err, capsize=4, color="0.15", marker="o", ms=6,
                      label="mean (bars: 95% t interval)")
        ax_g.legend(fontsize=8)
    else:
        empty_note(ax_g, "no point with both SSN and MAPL")
    for ax, ylabel, sub in ((ax_d, "Δ% val loss vs uncompressed", "each method's Δ% (bars: std over seeds)"),
                            (ax_g, "SSN Δ% − MAPL Δ% (points)", "paired SSN − MAPL gap (> 0: MAPL ahead)")):
        if ax is ax_g and not gaps:
            continue
        _log2_axis(ax)
        ax.set_xticks(xs)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=sub)
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.grid(alpha=0.3)
    ax_d.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def health_figure(runs: Sequence[dict], title: str = "") -> Figure:
    """Boundary health: max |z| of training messages against step (log scale), one panel per boundary,
    one line per run (colour and marker: method; line style: seed)."""
    n_b = max((len(r["health_readings"][0]["boundaries"]) for r in runs if r["health_readings"]), default=1)
    fig, axes = new_figure(n_b, 4.0, 3.6)
    for p, ax in enumerate(axes):
        for r in runs:
            pts = [(h["step"], h["boundaries"][p]["train_max"]) for h in r["health_readings"]
                   if h["boundaries"][p].get("train_max") is not None]
            if not pts:
                continue
            kw = {**style(r["variant"]), "ls": LINESTYLES[r["seed"] % len(LINESTYLES)], "lw": 1.0}
            x, y = zip(*pts)
            ax.plot(x, y, markevery=max(1, len(x) // 5), ms=4,
                    label=f"{label(r['variant'], r['wire_ratio'], r['projection_ratio'])} s{r['seed']}", **kw)
        ax.set_yscale("log")
        ax.set(xlabel="optimizer step", title=f"boundary {p}", ylabel="max |z| (training messages)" if p == 0 else "")
        ax.grid(alpha=0.3, which="both")
        if not runs:
            empty_note(ax, "no run recorded its boundary health")
    if runs:
        axes[-1].legend(fontsize=6)
    if title:
        fig.suptitle(title)
    return fig


def gap_curves_figure(gap: dict, generalisation: dict, title: str = "") -> Figure:
    """Left: the paired in-run gap (``gap``: {"steps", "mean", "lo", "hi"}, points) against step.
    Right: validation − training loss per method (``generalisation``: variant -> (steps, mean))."""
    fig, (ax_g, ax_o) = new_figure(2, 5.2, 4.0)
    if len(gap.get("steps", [])):
        ax_g.plot(gap["steps"], gap["mean"], color="black", marker="o", ms=4, lw=1.2, label="mean over seeds")
        ax_g.fill_between(gap["steps"], gap["lo"], gap["hi"], color="grey", alpha=0.25, lw=0, label="95% t interval")
        ax_g.axhline(0, color="grey", lw=0.8)
        ax_g.set(xlabel="optimizer step", ylabel="Δ%(SSN) − Δ%(MAPL), points", title="paired gap during training")
        ax_g.legend(fontsize=7)
        ax_g.grid(alpha=0.3)
    else:
        empty_note(ax_g, "fewer than 2 paired seeds")
    for variant, (steps, mean) in generalisation.items():
        ax_o.plot(steps, mean, ms=4, lw=1.2, label=variant_label(variant), **style(variant))
    if generalisation:
        ax_o.set(xlabel="optimizer step", ylabel="val − train loss", title="generalisation gap")
        ax_o.axhline(0, color="grey", lw=0.8)
        ax_o.legend(fontsize=7)
        ax_o.grid(alpha=0.3)
    else:
        empty_note(ax_o)
    if title:
        fig.suptitle(title)
    return fig


def paper_scatter_figure(cells: Sequence[dict], model: str | None = None) -> Figure:
    """Our Δ% (y, error bars: std over seeds) against the paper's Δ% (x) for the same method and
    projection ratio; one marker per method, filled at the headline budget, hollow at the main one;
    the diagonal is where they would agree."""
    fig, (ax,) = new_figure(1, 5.6, 4.4)
    if not cells:
        empty_note(ax, "no cell with a paper entry")
        return fig
    for c in cells:
        kw = style(c["variant"])
        hollow = {"mfc": "none"} if c["budget"] == "main" else {}
        ax.errorbar([c["paper"]], [c["ours"]], yerr=[c["std"] or 0.0], capsize=3, ms=7, ls="none",
                    **{k: v for k, v in kw.items() if k not in ("ls",)}, **hollow)
        ax.annotate(c["label"], (c["paper"], c["ours"]), fontsize=6, xytext=(4, 3), textcoords="offset points")
    hi = max(max(c["paper"] for c in cells), max(c["ours"] for c in cells)) * 1.1
    ax.plot([0, hi], [0, hi], color="0.6", lw=0.8, ls="--", label="ours = paper")
    ax.set(xlabel="paper Δ% (Table 1 / App. C, its scale)", ylabel="our Δ%" + (f" ({model})" if model else ""),
           title="our Δ% against the paper's, per cell")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
