"""Drawing on matplotlib's object API and the Agg canvas; colours and markers from style, labels placed to overlap nothing."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter, ScalarFormatter
from matplotlib.transforms import Bbox

from .render import Plot, fmt
from .rows import budget_steps, group_runs, is_reference, main_model, run_key, sort_key
from .stats import t_interval
from .style import NEUTRAL, bars_handle, bars_text, figure_label, fmt_ratio, label, linestyle, style, variant_label

__all__ = ["new_figure", "new_grid", "empty_note", "place_labels", "pareto_figure", "loss_curves_figure", "axis_figure",
           "health_figure", "gap_curves_figure", "paper_scatter_figure", "curves_plot", "health_plot"]

DELTA_LABEL = "Δ val loss vs uncompressed (%)"
STEP_LABEL = "optimizer step"
LOSS_LABEL = "loss (nats / token)"


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.8) -> tuple[Figure, list]:
    """A figure of ``ncols`` panels of ``width`` x ``height`` inches on the Agg canvas."""
    fig, grid = new_grid(1, ncols, width * ncols, height)
    return fig, list(grid[0])


def new_grid(nrows: int, ncols: int, width: float, height: float, **subplots) -> tuple[Figure, np.ndarray]:
    """A figure of ``nrows`` x ``ncols`` panels in ``width`` x ``height`` inches on the Agg canvas."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **subplots)


def empty_note(ax, text: str = "no runs") -> None:
    """Blank the axes with one line of grey text."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=NEUTRAL["note"], wrap=True)
    ax.set_xticks([]), ax.set_yticks([])


def _log2_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _zero_line(ax) -> None:
    ax.axhline(0.0, color=NEUTRAL["reference"], lw=0.8)


# ---- labels next to points, placed where they overlap nothing -----------------------------------------------
# candidate offsets (points) in order of preference: right, above-right, below-right, above, below, left side
_RADII = (4.0, 10.0, 17.0, 26.0, 38.0)
_ANGLES = (0, 35, -35, 90, -90, 145, -145, 180)
_MARKER_PT = 4.5          # half the side of the square each marker keeps free
_FREE = 0.5               # px²: an overlap below this is rounding in the box arithmetic, not a collision
_AMBIGUOUS = 400.0        # px²: the cost of a label nearer another point than its own (as a small overlap)


def _obstacles(ax, renderer) -> list[Bbox]:
    """Display-space boxes a label must not cover: every marker, error bar and text of ``ax``."""
    boxes, half = [], _MARKER_PT * ax.figure.dpi / 72
    for line in ax.get_lines():
        if line.get_marker() in (None, "", "None", " ") or not line.get_visible():
            continue
        for x, y in line.get_transform().transform(line.get_xydata()):
            if np.isfinite(x) and np.isfinite(y):
                boxes.append(Bbox([[x - half, y - half], [x + half, y + half]]))
    for coll in ax.collections:
        if isinstance(coll, LineCollection):
            for seg in coll.get_segments():
                if len(seg):
                    pts = coll.get_transform().transform(seg)
                    if np.isfinite(pts).all():
                        boxes.append(Bbox([pts.min(0) - 1, pts.max(0) + 1]))
    boxes += [t.get_window_extent(renderer) for t in ax.texts if t.get_visible() and t.get_text()]
    return boxes


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _distance(box: Bbox, xy) -> float:
    dx = max(box.x0 - xy[0], 0.0, xy[0] - box.x1)
    dy = max(box.y0 - xy[1], 0.0, xy[1] - box.y1)
    return math.hypot(dx, dy)


def _nearer_other(box: Bbox, anchors: Sequence, own: int) -> bool:
    """Whether a label at ``box`` sits nearer another labelled point than its own."""
    mine = _distance(box, anchors[own])
    return any(a is not None and j != own and _distance(box, a) < mine for j, a in enumerate(anchors))


def _alignment(angle: float) -> tuple[str, str]:
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    return ("left" if c > 0.3 else "right" if c < -0.3 else "center",
            "bottom" if s > 0.3 else "top" if s < -0.3 else "center")


def place_labels(ax, points: Sequence[tuple[float, float]], texts: Sequence[str], colours: Sequence[str] | None = None,
                 fontsize: float = 7) -> list:
    """Write ``texts[i]`` next to ``points[i]`` at the nearest offset that covers nothing (else the least); call it
    once the axes' limits and scales are final: it fixes the figure's layout."""
    fig = ax.figure
    fig.canvas.draw()                                 # run the layout once: the transforms are final from here on
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer).padded(-2)
    taken = _obstacles(ax, renderer)
    anchors = [ax.transData.transform((x, y)) if np.isfinite(x) and np.isfinite(y) else None for x, y in points]
    placed = []
    for i, ((x, y), text) in enumerate(zip(points, texts)):
        if anchors[i] is None:
            continue
        colour = colours[i] if colours else NEUTRAL["note"]
        best = None
        for radius in _RADII:
            for angle in _ANGLES:
                dx, dy = radius * math.cos(math.radians(angle)), radius * math.sin(math.radians(angle))
                ha, va = _alignment(angle)
                ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                                  fontsize=fontsize, color=colour)
                box = ann.get_window_extent(renderer)
                ann.remove()
                outside = max(0.0, box.width * box.height - _overlap(box, frame))
                cost = sum(_overlap(box, t) for t in taken) + 10 * outside + _AMBIGUOUS * _nearer_other(box, anchors, i)
                if best is None or cost < best[0]:
                    best = (cost, dx, dy, ha, va, radius, box)
                if cost < _FREE:
                    break
            if best[0] < _FREE:
                break
        _, dx, dy, ha, va, radius, box = best
        leader = {"arrowprops": {"arrowstyle": "-", "color": colour, "lw": 0.5, "shrinkA": 0, "shrinkB": 2}} \
            if radius > _RADII[1] else {}
        placed.append(ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                                  fontsize=fontsize, color=colour, **leader))
        taken.append(box)
    return placed


# ---- loss against communication ---------------------------------------------------------------------------
def _bars(s: dict, kind: str) -> tuple[float, float] | None:
    """(below, above) the mean Δ%: the sd over seeds (``sd``) or the 95 % t interval (``ci95``); None with one seed."""
    if kind == "ci95":
        ci = t_interval(list((s.get("deltas") or {}).values()))
        return None if ci is None else (s["delta_pct"] - ci[0], ci[1] - s["delta_pct"])
    return None if not s["delta_std"] else (s["delta_std"], s["delta_std"])


def _pareto_panel(ax, sums: Sequence[dict], xkey: str, bars: str) -> tuple[list, list, list]:
    """One setup's Δ% against ``xkey``, a line per variant; returns its points, wire ratios and colours."""
    lines = defaultdict(list)
    for s in sorted(sums, key=sort_key):
        if s[xkey]:
            lines[s["variant"]].append(s)
    points, texts, colours = [], [], []
    for variant, pts in lines.items():
        pts = sorted(pts, key=lambda s: -s[xkey])
        y = [0.0 if s["method"] == "none" else (s["delta_pct"] if s["delta_pct"] is not None else np.nan) for s in pts]
        err = [_bars(s, bars) if s["method"] != "none" else None for s in pts]
        yerr = np.array([e or (0.0, 0.0) for e in err]).T if any(err) else None
        ax.errorbar([s[xkey] for s in pts], y, yerr=yerr, capsize=3, ms=6, lw=1.0,
                    label=figure_label(variant, None), **style(variant))
        points += [(s[xkey], yy) for s, yy in zip(pts, y)]
        texts += [fmt_ratio(s["wire_ratio"]) for s in pts]
        colours += [style(variant)["color"]] * len(pts)
    _log2_axis(ax)
    _span_an_octave(ax, [x for x, _ in points])
    _zero_line(ax)
    ax.grid(alpha=0.3)
    return points, texts, colours


def _span_an_octave(ax, xs: Sequence[float]) -> None:
    """Widen a log2 x range to hold a power of two (a panel within one octave would have no tick label)."""
    xs = [x for x in xs if x and np.isfinite(x)]
    if not xs:
        return
    lo, hi = min(xs) / 1.4, max(xs) * 1.4
    if math.floor(math.log2(hi)) < math.ceil(math.log2(lo)):
        below = 2.0 ** math.floor(math.log2(lo))
        lo, hi = below / 1.2, max(hi, below * 1.2)
    ax.set_xlim(lo, hi)


def pareto_figure(sums: Sequence[dict], bars: str = "sd", main: str | None = None) -> Figure:
    """Δ% against forward (left) and total (right) bytes per token, a row of panels per (model, P, budget), a line
    per variant, each point labelled with its wire ratio."""
    setups = sorted({(s["model"], s["stages"], s["steps"]) for s in sums},
                    key=lambda k: (k[0] != main, str(k[0]), k[1], k[2])) or [None]
    fig, grid = new_grid(len(setups), 2, 7.4, 2.5 * len(setups) + 1.3)
    columns = (("fwd_bytes_per_token", "forward bytes / token / boundary (log₂)", "forward payload"),
               ("total_bytes_per_token", "total bytes / token / boundary (log₂)", "total: both directions, ids, sync"))
    ratio_labels = {}
    for row, setup in zip(grid, setups):
        for ax, (xkey, xlabel, what) in zip(row, columns):
            if setup is None:
                empty_note(ax, "no runs in group main")
                continue
            model, stages, steps = setup
            mine = [s for s in sums if (s["model"], s["stages"], s["steps"]) == setup]
            ratio_labels[ax] = _pareto_panel(ax, mine, xkey, bars)
            ax.set(xlabel=xlabel, ylabel=DELTA_LABEL)
            ax.set_title(f"{model}, P={stages}, {steps:,} steps\n{what}", fontsize=9)
    fig.suptitle("Loss against communication, token-matched")
    if sums:
        handles = {}
        for ax in grid.flat:
            handles.update(zip(*reversed(ax.get_legend_handles_labels())))
        labels = list(handles) + [bars_text(bars)]
        fig.legend([handles[k] for k in handles] + [bars_handle()], labels, loc="outside lower center",
                   ncol=min(3, len(labels)), fontsize=8)
        for ax, (points, texts, colours) in ratio_labels.items():
            place_labels(ax, points, texts, colours)
    return fig


# ---- loss curves -----------------------------------------------------------------------------------------
def _mean_curve(runs: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean, min and max over seeds of one curve, on the steps every seed has."""
    curves = [dict(r[key]) for r in runs if r[key]]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    ys = np.array([[c[s] for s in steps] for c in curves]) if steps else np.zeros((0, 0))
    if not steps:
        return (np.array([]),) * 4
    return np.array(steps), ys.mean(0), ys.min(0), ys.max(0)


def loss_curves_figure(rows: Sequence[dict], smooth: int | None = None, title: str = "") -> Figure:
    """Train loss (moving mean) and val loss against step, a line per configuration (band: the seeds' range)."""
    fig, (ax_t, ax_v) = new_figure(2, 3.8, 3.6)
    smooth = smooth or max(10, max((r["steps"] or 0 for r in rows), default=0) // 30)
    groups = group_runs(sorted(rows, key=sort_key))
    several_seeds = False
    for runs in groups.values():
        r = runs[0]
        name = figure_label(r["variant"], r["wire_ratio"], r["projection_ratio"])
        name += f", {len(runs)} seeds" if len(runs) > 1 else ""
        several_seeds |= len(runs) > 1
        kw = {**style(r["variant"]), "ls": linestyle(r["wire_ratio"]), "lw": 1.2}
        steps, mean, lo, hi = _mean_curve(runs, "train_loss_curve")
        if len(steps):
            y, lo_s, hi_s = (v if len(v) < smooth else np.convolve(v, np.ones(smooth) / smooth, mode="valid")
                             for v in (mean, lo, hi))
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
        ax.set(xlabel=STEP_LABEL, ylabel=LOSS_LABEL, title=sub)
        ax.grid(alpha=0.3)
    if groups:
        handles, labels = ax_v.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=7,
                   title=("line: mean over seeds; " + bars_text("range", "band")) if several_seeds else None,
                   title_fontsize=7)
        # clip the y range to the last 90% of the curves (the first steps' loss hides the rest)
        tails = [np.asarray(y)[len(y) // 10:] for y in (ln.get_ydata() for ln in ax_t.get_lines()) if len(y) > 10]
        if tails:
            lo, hi = min(t.min() for t in tails), max(t.max() for t in tails)
            ax_t.set_ylim(lo - 0.02 * (hi - lo), hi + 0.05 * (hi - lo))
    fig.suptitle(title or "Loss curves")
    return fig


# ---- the token and width axes ----------------------------------------------------------------------------
def _delta_series(ax, points: Sequence[dict], xkey: str, v: str, jitter: float) -> None:
    """One variant's Δ% against ``xkey``, with a gap (NaN) where it has no run."""
    have = [p for p in points if v in p["sums"] and p["sums"][v]["delta_pct"] is not None]
    if not have:
        return
    first, last = points.index(have[0]), points.index(have[-1])
    span = points[first:last + 1]
    ys = [p["sums"][v]["delta_pct"] if p in have else np.nan for p in span]
    err = [(p["sums"][v]["delta_std"] or 0.0) if p in have else np.nan for p in span]
    s0 = have[0]["sums"][v]
    ax.errorbar([p[xkey] * jitter for p in span], ys, yerr=err, capsize=3, ms=6,
                label=figure_label(v, s0["wire_ratio"], s0["projection_ratio"]), **style(v))


def _delta_axes(ax, xs: Sequence[float], xlabel: str, title: str, ylabel: str = DELTA_LABEL) -> None:
    _log2_axis(ax)
    ax.set_xticks(xs)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    _zero_line(ax)
    ax.grid(alpha=0.3)


def axis_figure(points: Sequence[dict], xkey: str, xlabel: str, variants: Sequence[str], title: str,
                empty: str, separate: Sequence[str] = ()) -> Figure:
    """Each variant's Δ% against ``xkey`` (``separate`` in a panel of their own) and the paired SSN - MAPL gap."""
    fig, axes = new_figure(3 if separate else 2, 3.4 if separate else 3.8, 3.5)
    ax_d, ax_g = axes[0], axes[-1]
    ax_s = axes[1] if separate else None
    fig.suptitle(title)
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
            _delta_axes(ax_s, xs, xlabel, f"{variant_label('mapl-rvq')} (own scale)")
        else:
            empty_note(ax_s, f"no {variant_label('mapl-rvq')} runs")
    gaps = [(p[xkey], p["gap"]) for p in points if p["gap"]]
    for x, g in gaps:
        ax_g.scatter([x] * g["n"], g["diffs"], s=14, color=style("ssn")["color"], alpha=0.45, lw=0)
    if gaps:
        mean = [g["mean"] for _, g in gaps]
        err = np.array([[g["mean"] - g["ci"][0], g["ci"][1] - g["mean"]] if g["ci"] else [0.0, 0.0] for _, g in gaps]).T
        ax_g.errorbar([x for x, _ in gaps], mean, yerr=err, capsize=4, color=NEUTRAL["ink"], marker="o", ms=6,
                      label="mean over seeds")
        ax_g.scatter([], [], s=14, color=style("ssn")["color"], alpha=0.45, lw=0, label="one seed")
        ssn, mapl = variant_label("ssn"), variant_label("mapl")
        _delta_axes(ax_g, xs, xlabel, f"paired {ssn} − {mapl} (> 0: {mapl} ahead)", f"{ssn} Δ − {mapl} Δ (% points)")
    else:
        empty_note(ax_g, "no point with both SSN and MAPL")
    _delta_axes(ax_d, xs, xlabel, "each method's Δ%")
    _axis_legend(fig, [ax for ax in axes if ax is not ax_g], ax_g if gaps else None)
    return fig


def _axis_legend(fig, delta_axes: Sequence, gap_axes) -> None:
    """One legend below the panels: the methods and their bars, then the gap panel's entries."""
    handles, labels = [], []
    for ax in delta_axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h), labels.append(lab)
    handles.append(bars_handle()), labels.append(f"Δ% panels, {bars_text('sd')}")
    if gap_axes is not None:
        h, lab = gap_axes.get_legend_handles_labels()
        handles += h + [bars_handle()]
        labels += [f"gap: {x}" for x in lab] + [f"gap, {bars_text('ci95')}"]
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=7)


# ---- boundary health -------------------------------------------------------------------------------------
def _wrap(text: str, width: int = 22) -> str:
    """Break a row label at ', ' or ' (' past ``width`` characters."""
    if len(text) <= width:
        return text
    for sep in (", ", " ("):
        cut = text.rfind(sep, 0, width + 1)
        if cut > 0:
            return text[:cut + (1 if sep == ", " else 0)] + "\n" + text[cut + len(sep) - (1 if sep == " (" else 0):].lstrip()
    return text


def health_figure(runs: Sequence[dict], title: str = "") -> Figure:
    """Boundary health: a row per configuration, a column per boundary, a line per seed, a tick at its first warning."""
    configs = defaultdict(list)             # (variant, wire ratio, projection ratio) -> its runs, in method order
    for r in sorted(runs, key=sort_key):
        configs[(r["variant"], r["wire_ratio"], r["projection_ratio"])].append(r)
    n_b = max((len(r["health_readings"][0]["boundaries"]) for r in runs if r["health_readings"]), default=1)
    fig, grid = new_grid(max(1, len(configs)), n_b, 7.0, 0.8 * max(1, len(configs)) + 1.3, sharex=True, sharey=True)
    fig.suptitle(title or "Boundary health")
    if not configs:
        empty_note(grid[0][0], "no run recorded its boundary health")
        return fig
    for row, ((variant, wire, proj), mine) in zip(grid, configs.items()):
        colour = style(variant)["color"]
        for p, ax in enumerate(row):
            for r in mine:
                pts = [(h["step"], h["boundaries"][p]["train_max"]) for h in r["health_readings"]
                       if p < len(h["boundaries"]) and h["boundaries"][p].get("train_max") is not None]
                ax.plot(*(zip(*pts) if pts else ([], [])), color=colour, lw=0.6, alpha=0.8)
                if r.get("first_warning_step") is not None:     # the run's, not a boundary's: a tick on the top edge
                    ax.plot([r["first_warning_step"]], [1.0], transform=ax.get_xaxis_transform(), ls="none",
                            marker="v", ms=4, color=NEUTRAL["ink"], clip_on=False)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="major")
            ax.tick_params(labelsize=7)
        seeds = f"{len(mine)} seed{'s' if len(mine) > 1 else ''}"
        row[0].set_ylabel(f"{_wrap(figure_label(variant, wire, proj))}\n({seeds})", rotation=0, ha="right",
                          va="center", fontsize=7, color=colour)
    for p, ax in enumerate(grid[0]):
        ax.set_title(f"boundary {p}", fontsize=9)
    for ax in grid[-1]:
        ax.set_xlabel(STEP_LABEL, fontsize=8)
    fig.supylabel("largest |z| of a training message (activation units, log)", fontsize=8)
    fig.legend([Line2D([], [], color=NEUTRAL["note"], lw=0.6),
                Line2D([], [], ls="none", marker="v", ms=4, color=NEUTRAL["ink"])],
               ["one seed (the row's colour)", "a seed's first outlier warning (its step)"],
               loc="outside lower center", ncol=2, fontsize=7)
    return fig


# ---- the in-run gap --------------------------------------------------------------------------------------
def gap_curves_figure(gap: dict, generalisation: dict, title: str = "") -> Figure:
    """Left: the paired in-run gap against step with its 95 % band. Right: validation − training loss per method."""
    fig, (ax_g, ax_o) = new_figure(2, 3.8, 3.4)
    ssn, mapl = variant_label("ssn"), variant_label("mapl")
    if len(gap.get("steps", [])):
        ax_g.plot(gap["steps"], gap["mean"], color=NEUTRAL["ink"], marker="o", ms=4, lw=1.2, label="mean over seeds")
        ax_g.fill_between(gap["steps"], gap["lo"], gap["hi"], color=NEUTRAL["fill"], alpha=0.3, lw=0,
                          label=bars_text("ci95", "band"))
        ax_g.axhline(0, color=NEUTRAL["reference"], lw=0.8)
        ax_g.set(xlabel=STEP_LABEL, ylabel=f"{ssn} Δ − {mapl} Δ (% points)",
                 title=f"paired gap (> 0: {mapl} ahead)")
        ax_g.legend(fontsize=7)
        ax_g.grid(alpha=0.3)
    else:
        empty_note(ax_g, "fewer than 2 paired seeds")
    for variant, (steps, mean) in generalisation.items():
        ax_o.plot(steps, mean, ms=4, lw=1.2, label=variant_label(variant, figure=True), **style(variant))
    if generalisation:
        ax_o.set(xlabel=STEP_LABEL, ylabel="val − train loss (nats / token)", title="val − train (mean over seeds)")
        ax_o.axhline(0, color=NEUTRAL["reference"], lw=0.8)
        ax_o.legend(fontsize=7)
        ax_o.grid(alpha=0.3)
    else:
        empty_note(ax_o)
    fig.suptitle(title or f"{ssn} − {mapl} gap during training")
    return fig


# ---- ours against the paper ------------------------------------------------------------------------------
def paper_scatter_figure(cells: Sequence[dict], model: str | None = None) -> Figure:
    """Our Δ% against the paper's per cell (hollow: main budget), each point numbered and keyed in the legend."""
    fig, (ax,) = new_figure(1, 7.4, 4.0)
    fig.suptitle("Our Δ% against the paper's, per cell" + (f" ({model})" if model else ""))
    if not cells:
        empty_note(ax, "no cell with a paper entry")
        return fig
    order = list(cells)
    handles, labels = [], []
    for i, c in enumerate(order, 1):
        kw = style(c["variant"])
        hollow = {"mfc": "none"} if c["budget"] == "main" else {}
        ax.errorbar([c["paper"]], [c["ours"]], yerr=[c["std"] or 0.0], capsize=3, ms=7, ls="none", **kw, **hollow)
        handles.append(Line2D([], [], ls="none", ms=6, **kw, **hollow))
        labels.append(f"{i}  {c['label']}")
    hi_x = max(c["paper"] for c in cells) * 1.08
    hi_y = max(c["ours"] + (c["std"] or 0.0) for c in cells) * 1.2
    lo_y = min(0.0, min(c["ours"] - (c["std"] or 0.0) for c in cells) * 1.2)
    diagonal, = ax.plot([0, hi_x], [0, hi_x], color=NEUTRAL["reference"], lw=0.8, ls="--")
    ax.set_xlim(0, hi_x)
    ax.set_ylim(lo_y, hi_y)
    ax.set(xlabel="paper Δ val loss (%; Table 1 / App. C, its scale)",
           ylabel="our Δ val loss (%)" + (f", {model}" if model else ""))
    ax.grid(alpha=0.3)
    fig.legend(handles + [diagonal, bars_handle()], labels + ["ours = paper", bars_text("sd")], loc="outside right center",
               fontsize=7, title="hollow: main budget; filled: headline", title_fontsize=7)
    place_labels(ax, [(c["paper"], c["ours"]) for c in order], [str(i) for i in range(1, len(order) + 1)],
                 [style(c["variant"])["color"] for c in order], fontsize=7)
    return fig


# ---- the figures that read rows only ---------------------------------------------------------------------
def curves_plot(rows: Sequence[dict], group: str) -> Plot:
    """Loss curves of the configurations of ``group``, with every seed of them from any group."""
    keys = {run_key(r, False) for r in rows if r["group"] == group}
    pick = [r for r in rows if run_key(r, False) in keys]
    steps = budget_steps(rows, group)
    title = f"Loss curves, group {group}" + (f" ({steps:,} steps)" if steps else "")
    fig = loss_curves_figure(pick, title=title)
    if not pick:
        return Plot(f"curves-{group}", f"Loss curves of group {group}.", f"no runs in group {group}.", fig, empty=True)
    finals = {}
    for r in pick:
        finals.setdefault((r["variant"], r["wire_ratio"], r["projection_ratio"]), []).append(r["val_loss"])
    best = min(finals, key=lambda k: sum(finals[k]) / len(finals[k]))
    dense = [r for r in pick if is_reference(r) and len(r["val_loss_curve"]) >= 2]
    still = ""
    if dense:                        # does the val loss still fall at the end of the budget?
        (s0, l0), (s1, l1) = dense[0]["val_loss_curve"][-2:]
        still = f"; the uncompressed val loss fell by {l0 - l1:.4f} over its last {s1 - s0:,} steps"
    caption = ("Train loss (moving mean) and validation loss against step; one line per configuration, the mean over "
               "its seeds with their range as a band; colour and marker: method; line style: wire ratio (solid ≤ 6×, "
               "dashed ≤ 12×, dotted ≤ 24×, dash-dot beyond).")
    takeaway = (f"Lowest final val loss: {label(*best)} {sum(finals[best]) / len(finals[best]):.4f}{still}.")
    return Plot(f"curves-{group}", caption, takeaway, fig)


def health_plot(rows: Sequence[dict], group: str = "long") -> Plot:
    """The early warning's trajectories of every run at the budget of ``group`` that recorded its boundary health."""
    model = main_model(rows)
    steps = budget_steps(rows, group, model)
    runs = [r for r in rows if r["steps"] == steps and r["model"] == model and r.get("health_recorded")]
    title = f"Boundary health, {model}, {steps:,} steps" if steps else "Boundary health"
    caption = ("Largest |z| of a training message, read every train.health_every steps (log scale): one row of panels "
               "per configuration at the long budget that recorded it, one column per boundary, one thin line per "
               "seed; a tick on the top edge marks the step of a seed's first outlier warning, which fires when a reading "
               "exceeds train.health_warn_factor x the median of every earlier reading (readings in the first 3 "
               "learning-rate warmups not judged).")
    if not runs:
        return Plot("health", caption, "no run at this budget recorded its boundary health (trained before the "
                    "monitor existed).", health_figure([], title), empty=True)
    peak = max(runs, key=lambda r: r["max_abs_z_peak"] or 0)
    warned = sorted({(r["variant"], r["seed"]) for r in runs if r["first_warning_step"] is not None})
    takeaway = (f"Largest max |z|: {label(peak['variant'], peak['wire_ratio'], peak['projection_ratio'])} seed "
                f"{peak['seed']}, {fmt(peak['max_abs_z_peak'], 1)} at boundary {peak['max_abs_z_boundary']}; "
                f"{len(warned)} of {len(runs)} runs raised an outlier warning.")
    return Plot("health", caption, takeaway, health_figure(sorted(runs, key=lambda r: (r["variant"], r["seed"])), title))
