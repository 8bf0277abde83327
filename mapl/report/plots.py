"""Each figure of the report with its caption and a takeaway computed from the numbers it shows.

    >>> plot = pareto_plot(rows)
    >>> plot.save(FIGURES)            # FIGURES/pareto.png
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from matplotlib.figure import Figure

from . import paper
from .figures import (axis_figure, gap_curves_figure, health_figure, loss_curves_figure, paper_scatter_figure,
                      pareto_figure, save_figure)
from .rows import at_best_validation, budget_steps, is_reference, main_model, run_key
from .studies import AXIS_VARIANTS, STUDY_VARIANTS, headline_ratio, headline_summaries, token_points, width_points
from .style import BARS, figure_label, fmt_ratio, label, variant_label
from .stats import t_interval
from .table import fmt, fmt_int
from .tables import table1_summaries

__all__ = ["Plot", "pareto_plot", "curves_plot", "tokens_plot", "width_plot", "health_plot", "gap_curves_plot",
           "paper_scatter_plot"]


@dataclass
class Plot:
    """A figure with its file stem, caption and one-line takeaway; ``empty``: no data to draw (the
    figure is a one-line note, still written so that the file always exists)."""
    name: str
    caption: str
    takeaway: str
    figure: Figure
    empty: bool = False

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / f"{self.name}.png"
        save_figure(self.figure, path)
        return path


def _bytes_takeaway(sums: Sequence[dict], ratio: float | None) -> str:
    """Forward vs total bytes of the methods at projection ratio ``ratio`` (the headline's)."""
    picks = [s for s in sums if s["method"] != "none" and s["total_bytes_per_token"] and s["projection_ratio"] == ratio]
    if not picks:
        return "no compressed runs with byte counts."
    parts = [f"{label(s['variant'], s['wire_ratio'], s['projection_ratio'])} {fmt(s['fwd_bytes_per_token'], 0)} → "
             f"{fmt(s['total_bytes_per_token'], 1)}" for s in picks]
    return ("Forward → total bytes per token and boundary: " + "; ".join(parts)
            + ". The total counts the backward gradients, token ids, the projector exchange and codebook sync.")


def pareto_plot(rows: Sequence[dict], group: str | None = None, sums: Sequence[dict] | None = None,
                takeaway: Callable[[Sequence[dict]], str] | None = None) -> Plot:
    """Δ% against forward and total bytes per token: at the main budget (Table 1's runs), or with
    ``group`` at that group's budget (``"long"``: the headline, every seed; file ``pareto-<group>``); ``sums``: the
    summaries to draw instead and ``takeaway`` the sentence they get (the frontier's every projection ratio:
    :func:`mapl.report.controls.frontier_plot`; default: forward against total bytes at the headline's ratio)."""
    if sums is None:
        sums = table1_summaries(rows) if group is None else headline_summaries(rows, group)
    budget = ("each model's main budget" if group is None
              else f"the budget of group {group} ({fmt_int(sums[0]['steps'] if sums else 0)} steps)")
    # the main budget has two seeds, where a 95 % interval is ±9 sd wide and says nothing; the headline has eight
    # and is read as a comparison, so its bars are the interval of the mean
    bars = "sd" if group is None else "ci95"
    caption = (f"Δ% of validation loss against bytes per token and boundary at {budget}, token-matched, one row of "
               f"panels per model, P and budget; error bars: {BARS[bars]}; point labels: wire ratio (2d / forward "
               "bytes). Left: the forward payload, as the paper counts it. Right: total = (forward + backward + token "
               "ids + projector exchange + codebook sync) bytes of the run / (training tokens × boundaries).")
    sentence = (f"no runs in group {group or 'main'}." if not sums else takeaway(sums) if takeaway
                else _bytes_takeaway(sums, headline_ratio(rows)))
    return Plot("pareto" if group is None else f"pareto-{group}", caption, sentence,
                pareto_figure(sums, bars, main_model(rows)), empty=not sums)


def curves_plot(rows: Sequence[dict], group: str) -> Plot:
    """Loss curves of the configurations of ``group``, with every seed of them from any group (mean
    over seeds, band = range)."""
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


def tokens_plot(rows: Sequence[dict], takeaway: str, best: bool = False) -> Plot:
    """The token axis (``takeaway``: the token table's, the same numbers); ``best``: at each run's best
    validation loss (:func:`mapl.report.rows.at_best_validation`)."""
    points = token_points(at_best_validation(rows) if best else rows)
    ratio = headline_ratio(rows)
    fig = axis_figure(points, "steps", "optimizer steps (log; tokens ∝ steps)", AXIS_VARIANTS[1:],
                      f"Token axis at projection ratio {fmt_ratio(ratio)}"
                      + (", best validation loss per run" if best else ""), "fewer than two budgets with runs",
                      separate=("mapl-rvq", "mapl-rvq-scaled"))
    caption = ("Left: each method's Δ% against the training budget (mean; bars: ±1 sd over seeds; no line across a "
               "budget a method did not run). Middle: MAPL+VQ on its own scale. Right: the paired SSN − MAPL "
               "difference of Δ% (positive: MAPL ahead), its mean with the Student t 95 % interval and every seed "
               "as a dot." + (" Every run is scored at its best step, chosen on the selection set (early "
                              "stopping)." if best else ""))
    return Plot("tokens-best" if best else "tokens", caption, takeaway, fig, empty=len(points) < 2)


def width_plot(rows: Sequence[dict], takeaway: str) -> Plot:
    """The width axis (``takeaway``: the width table's)."""
    points = width_points(rows)
    steps = points[0]["steps"] if points else None
    fig = axis_figure(points, "d", "model width d (log)", AXIS_VARIANTS[1:],
                      f"Width axis at projection ratio {fmt_ratio(headline_ratio(rows))}, {fmt_int(steps)} steps",
                      "no runs in group width")
    caption = ("Left: each method's Δ% against the model width d at the main budget (bars: ±1 sd over seeds where "
               "there are several). Right: the paired SSN − MAPL gap per width (bars: 95 % t interval of the mean).")
    return Plot("width", caption, takeaway, fig, empty=len(points) < 2)


def health_plot(rows: Sequence[dict], group: str = "long") -> Plot:
    """The early warning's trajectories: every run at the budget of ``group`` that recorded its
    boundary health (runs trained before the monitor existed have none)."""
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


def _in_run_gap(sums: dict) -> dict:
    """Per evaluation step, the paired SSN − MAPL difference of Δ% over the seeds all three methods
    (none, ssn, mapl) have, each seed against its own uncompressed run at the same step."""
    curves = {v: {r["seed"]: dict(r["val_loss_curve"]) for r in sums[v]} for v in ("none", "ssn", "mapl") if v in sums}
    if len(curves) < 3:
        return {}
    seeds = sorted(set.intersection(*(set(c) for c in curves.values())))
    steps = sorted(set.intersection(*(set(curves[v][s]) for v in curves for s in seeds))) if seeds else []
    out = {"steps": [], "mean": [], "lo": [], "hi": []}
    for step in steps:
        diffs = [100 * (curves["ssn"][s][step] - curves["mapl"][s][step]) / curves["none"][s][step] for s in seeds]
        ci = t_interval(diffs)
        if ci is None:
            return {}
        out["steps"].append(step)
        out["mean"].append(sum(diffs) / len(diffs))
        out["lo"].append(ci[0])
        out["hi"].append(ci[1])
    return out


def _generalisation(runs_by_variant: dict) -> dict:
    """variant -> (eval steps, mean over seeds of val loss − the mean train loss of the steps since the
    previous evaluation)."""
    out = {}
    for variant, runs in runs_by_variant.items():
        per_seed = []
        for r in runs:
            train = dict(r["train_loss_curve"])
            points, prev = {}, 0
            for step, val in r["val_loss_curve"]:
                window = [train[s] for s in range(prev + 1, step + 1) if s in train]
                if window:
                    points[step] = val - sum(window) / len(window)
                prev = step
            per_seed.append(points)
        steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
        if steps:
            out[variant] = (steps, [sum(p[s] for p in per_seed) / len(per_seed) for s in steps])
    return out


def gap_curves_plot(rows: Sequence[dict], group: str = "long") -> Plot:
    """The in-run paired SSN − MAPL gap against step (free, from the loss curves of the headline runs)
    and each method's validation − training loss."""
    model = main_model(rows)
    steps = budget_steps(rows, group, model)
    ratio = headline_ratio(rows)
    pool = [r for r in rows if r["group"] == group and r["model"] == model and r["steps"] == steps
            and (r["method"] == "none" or r["projection_ratio"] == ratio) and r["variant"] in STUDY_VARIANTS]
    by_variant = {}
    for r in pool:
        by_variant.setdefault(r["variant"], []).append(r)
    gap = _in_run_gap(by_variant)
    caption = (f"Group {group}, the main model at projection ratio {fmt_ratio(ratio)}. Left: per evaluation, "
               "Δ%(SSN) − Δ%(MAPL) on the same seed (each against that seed's uncompressed run at that step), "
               "mean and Student t 95% interval over seeds (positive: MAPL ahead). Right: validation loss minus "
               "the mean training loss since the previous evaluation, mean over seeds.")
    if gap:
        last = len(gap["steps"]) - 1
        takeaway = (f"At step {fmt_int(gap['steps'][last])} MAPL leads SSN by {gap['mean'][last]:+.2f} points "
                    f"[{gap['lo'][last]:+.2f}, {gap['hi'][last]:+.2f}]; the interval excludes 0 at "
                    f"{sum(lo > 0 or hi < 0 for lo, hi in zip(gap['lo'], gap['hi']))} of {len(gap['steps'])} "
                    f"evaluations.")
    else:
        takeaway = f"fewer than two seeds with none, SSN and MAPL in group {group}: no paired gap."
    # the headline's figure keeps its name; another group's (the corpus study's) gets its own file
    name = "gap-curves" if group == "long" else f"gap-curves-{group.replace('_', '-')}"
    title = (f"{variant_label('ssn')} − {variant_label('mapl')} gap during training, group {group} ({model}, "
             f"{fmt_int(steps)} steps)")
    return Plot(name, caption, takeaway, gap_curves_figure(gap, _generalisation(by_variant), title), empty=not gap)


def paper_scatter_plot(rows: Sequence[dict]) -> Plot:
    """Our Δ% against the paper's for every method and projection ratio both have: the main budget
    (Table 1 analog, hollow) and the headline budget (group long, filled), of the main model (another model's
    runs, e.g. blocks' mini at its own budget, have their own table)."""
    cells, model = [], main_model(rows)
    main = [s for s in table1_summaries(rows) if s["model"] == model]
    for budget, sums in (("main", main), ("long", headline_summaries(rows))):
        for s in sums:
            if s["method"] == "none" or s["delta_pct"] is None:
                continue
            if s["variant"] == "mapl-fixed":
                p = next((e for e in paper.paper_ablation("projector") if e["variant"] == "fixed"), None)
            elif s["variant"] in (s["method"], "mapl-rvq-scaled"):
                p = paper.paper_match(s["method"], s["projection_ratio"], s["stages"], s["model"])
            else:
                p = None
            if p is None:
                continue
            cells.append({"variant": s["variant"], "budget": budget, "paper": p["delta_pct"], "ours": s["delta_pct"],
                          "std": s["delta_std"], "label": f"{figure_label(s['variant'], s['wire_ratio'], s['projection_ratio'])}"
                                                           f", {fmt_int(s['steps'])} steps"})
    caption = (f"Each of our cells of the main model ({model}; the main budget hollow, the headline budget filled; "
               "bars: ±1 sd over seeds; each point numbered, its cell named in the key) at the "
               "paper's Δ% for the same method and projection ratio (Table 1 at its matching scale; the fixed "
               "projector: Appendix C at 4×). On the dashed line the two agree.")
    ssn = [c for c in cells if c["variant"] == "ssn"]
    ours = ", ".join(f"{c['ours']:+.2f}" for c in ssn)
    theirs = ", ".join(f"{c['paper']:+.2f}" for c in ssn)
    takeaway = (f"SSN: ours {ours} % against the paper's {theirs} % for the same cells."
                if ssn else "no SSN cell with a paper entry.")
    return Plot("paper-scatter", caption, takeaway, paper_scatter_figure(cells, model), empty=not cells)
