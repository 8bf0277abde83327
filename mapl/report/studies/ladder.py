"""The scale ladder: the slope of the paired SSN − MAPL gap against ln(non-embedding parameters)."""
from __future__ import annotations

import math
import re
import statistics
from typing import Sequence

import numpy as np

from ...core.model_config import PRESETS, count_params
from ..figures import empty_note, new_figure
from ..render import DASH, Plot, Table, fmt, fmt_ci, fmt_int, fmt_pm
from ..rows import boundary_mean, declared
from ..stats import paired, summarize, t_interval, t_quantile
from ..style import BARS, NEUTRAL, colour, variant_label

__all__ = ["PAPER_SIZES", "SIZE_UNIT", "rung_params", "ladder_rungs", "gap_slope", "size_length_fit",
           "size_length_table", "ladder_table",
           "ladder_tuning_table", "ladder_plot", "ladder_slope_comparison"]

_RUNG = re.compile(r"^ladder-d(\d+)$")
# the paper's sizes on the same axis: the non-embedding parameters of our presets of those names (their d is the
# paper's; the rest is our choice, mapl/core/model_config.py)
PAPER_SIZES = {name: count_params(PRESETS[name], include_embeddings=False) for name in ("150M", "500M", "1B")}


def rung_params(model: str) -> int | None:
    """Non-embedding parameters of a ladder preset (None for another model)."""
    return count_params(PRESETS[model], include_embeddings=False) if _RUNG.match(model or "") else None


def ladder_rungs(rows: Sequence[dict]) -> list[dict]:
    """Per rung with runs (smallest first): size, budget, ``sums`` (variant -> summary), ``gap`` and ``geometry``."""
    groups = set(declared().groups_of("ladder"))
    mine = [r for r in rows if r["group"] in groups and _RUNG.match(r["model"] or "")]
    out = []
    # a cell is a rung at one training length: the budget rule gives each rung one, the size-vs-length cells more
    for model, steps in sorted({(r["model"], r["steps"]) for r in mine}, key=lambda k: (rung_params(k[0]), k[1])):
        pool = [r for r in mine if r["model"] == model and r["steps"] == steps and r["method"] in ("none", "ssn", "mapl")
                and r["variant"] in ("none", "ssn", "mapl")]
        sums = {s["variant"]: s for s in summarize(pool, rows)}
        gap = None
        if "ssn" in sums and "mapl" in sums:
            p = paired(sums["ssn"]["deltas"], sums["mapl"]["deltas"])
            gap = {"a": sums["ssn"], "b": sums["mapl"], **p} if p else None
        split = {r.get("train_split_tokens") for r in pool} - {None}
        out.append({"model": model, "d": int(_RUNG.match(model).group(1)), "params": rung_params(model),
                    "steps": steps, "tokens": max((r["tokens"] or 0) for r in pool) if pool else None,
                    "train_split_tokens": split.pop() if len(split) == 1 else None,
                    "sums": sums, "gap": gap, "geometry": _mapl_energy([r for r in pool if r["variant"] == "mapl"])})
    return out


def _mapl_energy(mapl: Sequence[dict]) -> tuple[float, float] | None:
    """MAPL's captured boundary energy and the best rank-r basis's, mean over boundaries and seeds."""
    captured = boundary_mean(mapl, "captured_energy")
    return None if captured is None else (captured, boundary_mean(mapl, "pca_energy"))


def _points(rungs: Sequence[dict], unit: str, drop_seeds: Sequence[int] = ()) -> list[tuple[dict, float]]:
    """(cell, gap) per paired seed (``unit`` "seed") or per cell, its mean gap (``unit`` "cell")."""
    pts = []
    for r in rungs:
        if not r["gap"]:
            continue
        diffs = [d for s, d in zip(r["gap"]["seeds"], r["gap"]["diffs"]) if s not in drop_seeds]
        if diffs:
            pts += [(r, d) for d in diffs] if unit == "seed" else [(r, statistics.fmean(diffs))]
    return pts


def gap_slope(rungs: Sequence[dict], level: float = 0.95, unit: str = "seed",
              drop_seeds: Sequence[int] = ()) -> dict | None:
    """Least-squares fit of the gap on ln(parameters) alone, one point per paired seed (``unit`` "seed") or per cell
    ("cell"), ``ci`` on n − 2 df; None if under-determined (under two sizes, or no degree of freedom)."""
    pts = [(math.log(r["params"]), d) for r, d in _points(rungs, unit, drop_seeds)]
    xs = {x for x, _ in pts}
    if len(xs) < 2 or len(pts) < 3:
        return None
    n = len(pts)
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    resid = sum((y - intercept - slope * x) ** 2 for x, y in pts)
    se = math.sqrt(resid / (n - 2) / sxx) if n > 2 else float("nan")
    half = t_quantile(0.5 + level / 2, n - 2) * se
    return {"slope": slope, "intercept": intercept, "se": se, "ci": (slope - half, slope + half), "n": n,
            "rungs": len(xs), "level": level, "mean_x": mx, "sxx": sxx, "resid_var": resid / (n - 2)}


# The primary analysis of the scale ladder, declared before the size-vs-length cells ran (params.yaml
# ``ladder.primary``): the coefficient of ln(non-embedding parameters) in an ordinary least-squares fit of the cell
# mean paired SSN − MAPL gap (8×) on ln(parameters) and ln(steps), with its 95 % t interval on cells − 3 degrees of
# freedom. The cell (a rung at one training length), not the seed, is the unit: what varies between cells (the
# rate each rung was tuned at, the data it read) is not seed noise, and seeds pooled would count it as replication.
SIZE_UNIT = "cell"


def size_length_fit(rungs: Sequence[dict], unit: str = SIZE_UNIT, drop_seeds: Sequence[int] = (),
                    level: float = 0.95) -> dict:
    """The gap on [1, ln params, ln steps]: ``size`` (its coefficient), ``ci``, ``df``, ``n`` points, ``cells``,
    ``corr`` (of ln params and ln steps over the cells) and ``identified`` (False: no interval, ``why`` says)."""
    pts = _points(rungs, unit, drop_seeds)
    cells = {(r["model"], r["steps"]) for r, _ in pts}
    x = np.array([[1.0, math.log(r["params"]), math.log(r["steps"])] for r, _ in pts]).reshape(-1, 3)
    y = np.array([d for _, d in pts])
    logs = np.array([[math.log(rung_params(m)), math.log(s)] for m, s in sorted(cells)]).reshape(-1, 2)
    corr = float(np.corrcoef(logs.T)[0, 1]) if len(cells) >= 2 and logs.std(axis=0).all() else None
    out = {"unit": unit, "n": len(pts), "cells": len(cells), "df": len(pts) - 3, "corr": corr, "level": level,
           "size": None, "steps_coef": None, "se": None, "ci": None, "identified": False}
    if len(cells) < 3 or np.linalg.matrix_rank(x) < 3 or len(pts) <= 3:
        out["why"] = (f"{len(cells)} cell(s) give {len(pts)} point(s) for 3 coefficients: no degree of freedom"
                      if len(pts) <= 3 else "size and training length are collinear on the cells run")
        return out
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    cov = float(resid @ resid) / (len(pts) - 3) * np.linalg.inv(x.T @ x)
    se = math.sqrt(cov[1, 1])
    half = t_quantile(0.5 + level / 2, len(pts) - 3) * se
    return {**out, "size": float(coef[1]), "steps_coef": float(coef[2]), "se": se,
            "ci": (float(coef[1]) - half, float(coef[1]) + half), "identified": True, "why": ""}


def ladder_slope_comparison(rows: Sequence[dict]) -> dict | None:
    """The slope on size alone as a comparison (``mean``, ``ci``, ``n``, ``level``), with the rungs' span and the
    primary analysis (``size``: :func:`size_length_fit`) the ledger reads."""
    rungs = ladder_rungs(rows)
    fit = gap_slope(rungs)
    if fit is None:
        return None
    span = [r for r in rungs if r["gap"]]
    return {"mean": fit["slope"], "ci": fit["ci"], "n": fit["n"], "level": fit["level"], "std": None,
            "rungs": fit["rungs"], "params": (span[0]["params"], span[-1]["params"]),
            "steps": (span[0]["steps"], span[-1]["steps"]), "size": size_length_fit(rungs)}


_ANALYSES = (("primary: size, steps held", "size", "cell", ()),
             ("size, steps held", "size", "seed", ()),
             ("size, steps held, without seed 0", "size", "seed", (0,)),
             ("size alone (steps move with it)", "slope", "cell", ()),
             ("size alone (steps move with it)", "slope", "seed", ()),
             ("size alone, without seed 0", "slope", "seed", (0,)))


def _analysis_row(rungs: Sequence[dict], name: str, model: str, unit: str, drop: tuple) -> list:
    unit_name = "cell means" if unit == "cell" else "seeds pooled"
    if model == "size":
        f = size_length_fit(rungs, unit, drop)
        if not f["identified"]:
            return [name, unit_name, f["n"], f["cells"], f["df"], "not identified", f["why"], DASH]
        return [name, unit_name, f["n"], f["cells"], f["df"], f"{f['size']:+.2f}", fmt_ci(f["ci"]),
                f"{f['steps_coef']:+.2f}"]
    f = gap_slope(rungs, unit=unit, drop_seeds=drop)
    if f is None:
        return [name, unit_name, DASH, DASH, DASH, "not identified", "fewer than two sizes or no degree of freedom",
                DASH]
    return [name, unit_name, f["n"], f["rungs"], f["n"] - 2, f"{f['slope']:+.2f}", fmt_ci(f["ci"]), DASH]


def size_length_table(rows: Sequence[dict]) -> Table:
    """The scale ladder's primary analysis and its secondaries: the gap's coefficient of ln(parameters) with and
    without ln(steps) held, per cell and with seeds pooled, with and without the tuning seed (``size-length.md``)."""
    rungs = [r for r in ladder_rungs(rows) if r["gap"]]
    header = ["analysis", "unit", "points", "cells", "df", "ln(params) coefficient (points)", "95% CI",
              "ln(steps) coefficient"]
    body = [_analysis_row(rungs, *a) for a in _ANALYSES] if rungs else []
    primary = size_length_fit(rungs) if rungs else None
    cells = ", ".join(f"{r['model']} at {fmt_int(r['steps'])} steps" for r in rungs)
    caption = ("Does MAPL's lead grow with model size, or with training length? The paired SSN − MAPL gap at 8× "
               "(points; > 0: MAPL ahead) fitted by least squares on ln(non-embedding parameters) and ln(steps). "
               "Primary, named before the size-vs-length cells ran: the ln(parameters) coefficient with ln(steps) "
               "held, one point per cell (a rung at one training length: its mean over seeds), 95 % t interval on "
               "cells − 3 df. Secondary: seeds pooled (one point per paired seed; between-cell variation counted "
               "as replication), without seed 0 (each rung's tuning seed), and the slope on size alone. Cells: "
               f"{cells or 'none yet'}. The budget rule (2 tokens per parameter) makes steps grow with parameters; "
               "params.yaml ladder.length_cells declares the cells that break the collinearity. Disclosed: the top "
               "rung was declared as d = 192 and cut to d = 160 after the d64 and d128 rungs had results, before "
               "any run of it (a d = 192 run costs about an hour here).")
    if primary is None:
        takeaway = "no paired runs of the scale ladder yet."
    elif not primary["identified"]:
        corr = f"ln(params) and ln(steps) correlate at r = {primary['corr']:.6f} over the cells; " \
            if primary["corr"] is not None else ""
        takeaway = (f"Size and training length are not separated yet: {corr}the primary coefficient is not "
                    f"identified ({primary['why']}). The slope on size alone cannot tell a gap that grows with size "
                    "from one that grows with training length.")
    else:
        takeaway = (f"With training length held, the gap changes by {primary['size']:+.2f} points per ln(parameters), "
                    f"95% interval {fmt_ci(primary['ci'])} ({primary['cells']} cells, {primary['df']} df).")
    return Table("size-length", "Scale ladder: model size against training length", header, body, caption, takeaway)


def ladder_table(rows: Sequence[dict]) -> Table:
    """One row per rung: size, budget, each method's Δ%, the paired gap, MAPL's captured energy, bytes."""
    rungs = ladder_rungs(rows)
    body = []
    for r in rungs:
        s, g = r["sums"], r["gap"]
        none = s.get("none")
        body.append([r["model"], r["d"], f"{r['params'] / 1e6:.2f}M", fmt_int(r["steps"]),
                     f"{r['tokens'] / r['params']:.2f}" if r["tokens"] else DASH,
                     f"{r['tokens'] / r['train_split_tokens']:.2f}" if r["train_split_tokens"] and r["tokens"] else DASH,
                     ",".join(map(str, none["seeds"])) if none else DASH,
                     fmt_pm(none["val_loss"], none["val_loss_std"]) if none else DASH,
                     *(fmt_pm(s[v]["delta_pct"], s[v]["delta_std"], 2, pct=True) if v in s else DASH
                       for v in ("ssn", "mapl")),
                     fmt_pm(g["mean"], g["std"], 2) if g else DASH, fmt_ci(g["ci"]) if g else DASH,
                     "{:.3f} / {:.3f}".format(*r["geometry"]) if r["geometry"] else DASH,
                     " / ".join(fmt(s[v]["total_bytes_per_token"], 1) for v in ("ssn", "mapl") if v in s) or DASH])
    fit = gap_slope(rungs)
    caption = ("The scale ladder (study ladder): the ladder-d presets (8 layers, P = 4: two blocks per stage) on the "
               "code corpus, every rung at the same tokens per non-embedding parameter and each method at the "
               "learning rate tuned at that rung (ladder-tuning.md). Δ%: mean ± sd over seeds against the same "
               "seed's uncompressed run; gap: paired SSN − MAPL (points; > 0: MAPL ahead) with its 95 % t interval; "
               "energy: MAPL's captured boundary energy / the best rank-r basis's (mean over boundaries and seeds); "
               "bytes: all bytes per token of SSN / MAPL; epochs: training tokens over the training split.")
    if not body:
        takeaway = "no runs of the scale ladder yet (params.yaml ladder; docs/reproducing.md)."
    elif fit is None:
        takeaway = "fewer than two rungs with paired SSN and MAPL runs: no slope yet."
    else:
        takeaway = (f"Slope of the SSN − MAPL gap per ln(parameters): {fit['slope']:+.2f} points, 95% interval "
                    f"{fmt_ci(fit['ci'])} ({fit['n']} paired seeds on {fit['rungs']} rungs, "
                    f"{rungs[0]['params'] / 1e6:.2f}M-{rungs[-1]['params'] / 1e6:.2f}M parameters).")
    header = ["rung", "d", "params (non-emb.)", "steps", "tokens/param", "epochs", "seeds", "none val loss",
              "SSN Δ%", "MAPL Δ%", "gap SSN − MAPL", "gap 95% CI", "MAPL energy / best", "B/tok SSN / MAPL"]
    return Table("ladder", "Scale ladder: the SSN − MAPL gap against model size", header, body, caption, takeaway)


def ladder_plot(rows: Sequence[dict], paper_rows: Sequence[dict] = ()) -> Plot:
    """Left: Δ% against parameters (``paper_rows``: Table 1's). Right: the gap, its slope, extrapolated to 150M."""
    rungs = [r for r in ladder_rungs(rows) if r["sums"]]
    fig, (ax, gap_ax) = new_figure(2, width=5.2, height=4.0)
    caption = (f"Left: Δ% of SSN and MAPL at 8× against non-embedding parameters (log scale), error bars: "
               f"{BARS['ci95']}; crosses: the paper's Table 1 at 150M, 500M and 1B (P = 4), placed at those presets' "
               "non-embedding parameters. Right: the paired "
               f"SSN − MAPL gap per rung ({BARS['ci95']}), the least-squares line in ln(parameters) with its 95 % "
               "band, and that line extended to 150M (dashed): an extrapolation, not a measurement.")
    fig.suptitle("Scale ladder at 8×")
    if not rungs:
        for a in (ax, gap_ax):
            empty_note(a, "no runs of the scale ladder yet")
        return Plot("ladder", caption, "no runs of the scale ladder yet.", fig, empty=True)
    for k, v in enumerate(("ssn", "mapl")):
        pts = [(r["params"], r["sums"][v]) for r in rungs if v in r["sums"]]
        xs = [p * (1.0 + 0.04 * (k - 0.5)) for p, _ in pts]
        ys = [s["delta_pct"] for _, s in pts]
        cis = [t_interval(list(s["deltas"].values())) for _, s in pts]
        err = [[y - (c[0] if c else y) for y, c in zip(ys, cis)], [(c[1] if c else y) - y for y, c in zip(ys, cis)]]
        ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, color=colour(v), label=f"{variant_label(v)} (ours)")
        paper = [(PAPER_SIZES[p["scale"]], p["value"]) for p in paper_rows if p["method"] == v]
        if paper:
            ax.scatter(*zip(*paper), marker="x", color=colour(v), label=f"{variant_label(v)} (paper)")
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters (log)")
    ax.set_ylabel("Δ% of validation loss (%)")
    ax.axhline(0, color=NEUTRAL["reference"], linewidth=0.8)
    ax.set_title("Δ% against model size")
    ax.legend(fontsize=7)
    gaps = [r for r in rungs if r["gap"]]
    for r in gaps:
        g = r["gap"]
        lo, hi = g["ci"] if g["ci"] else (g["mean"], g["mean"])
        gap_ax.errorbar([r["params"]], [g["mean"]], yerr=[[g["mean"] - lo], [hi - g["mean"]]], fmt="o", capsize=3,
                        color=NEUTRAL["ink"])
        gap_ax.scatter([r["params"]] * g["n"], g["diffs"], color=NEUTRAL["fill"], s=10)
    fit = gap_slope(rungs)
    if fit:
        _slope_line(gap_ax, fit, [r["params"] for r in gaps])
    gap_ax.axhline(0, color=NEUTRAL["guide"], linestyle=":", linewidth=1)
    gap_ax.set_xscale("log")
    gap_ax.set_xlabel("non-embedding parameters (log)")
    gap_ax.set_ylabel("SSN − MAPL (points; > 0: MAPL ahead)")
    gap_ax.set_title("paired gap and its slope")
    takeaway = (f"Slope {fit['slope']:+.2f} points per ln(parameters), 95% interval {fmt_ci(fit['ci'])}."
                if fit else "fewer than two rungs with paired runs: no slope yet.")
    return Plot("ladder", caption, takeaway, fig)


def _slope_line(ax, fit: dict, measured: Sequence[float]) -> None:
    """The fitted line over the measured rungs with its 95 % band, and dashed out to 150M."""
    tq = t_quantile(0.5 + fit["level"] / 2, fit["n"] - 2)
    lo_x, hi_x = math.log(min(measured)), math.log(max(measured))
    for x0, x1, style, name in ((lo_x, hi_x, "-", "least-squares fit"),
                                (hi_x, math.log(PAPER_SIZES["150M"]), "--",
                                 f"extrapolated to 150M ({PAPER_SIZES['150M'] / 1e6:.0f}M non-emb.; not measured)")):
        xs = np.linspace(x0, x1, 40)
        ys = fit["intercept"] + fit["slope"] * xs
        half = tq * np.sqrt(fit["resid_var"] * (1 / fit["n"] + (xs - fit["mean_x"]) ** 2 / fit["sxx"]))
        ax.plot(np.exp(xs), ys, style, color=NEUTRAL["ink"], linewidth=1, label=name)
        ax.fill_between(np.exp(xs), ys - half, ys + half, color=NEUTRAL["fill"], alpha=0.15 if style == "-" else 0.07)
    ax.legend(fontsize=7)


def ladder_tuning_table(rows_all: Sequence[dict]) -> Table:
    """Every ladder tuning run per rung and method, the winner marked (read from the ladder's seed-0 run)."""
    decl = declared()
    tuning, winners = set(decl.groups_of("ladder_tune")), set(decl.groups_of("ladder"))
    tune = [r for r in rows_all if r["group"] in tuning or (r["group"] in winners and r["seed"] == 0)]
    body, edges = [], []
    for model in sorted({r["model"] for r in tune}, key=lambda m: rung_params(m) or 0):
        for method in ("none", "ssn", "mapl"):
            cells = sorted((r for r in tune if r["model"] == model and r["method"] == method),
                           key=lambda r: r["lr_muon"] or 0)
            scored = [r for r in cells if r.get("select_loss") is not None]
            if not scored:
                continue
            best = min(scored, key=lambda r: r["select_loss"])
            inside = best is not scored[0] and best is not scored[-1]
            if not inside:
                edges.append(f"{model} {variant_label(method)}")
            for r in cells:
                body.append([model, variant_label(method), f"{r['lr_muon']:g}", fmt_int(r["steps"]),
                             fmt(r.get("select_loss")), fmt(r["val_loss"]), "✓" if r is best else "",
                             ("inside" if inside else "on the edge") if r is best else ""])
    caption = ("Each method's Muon learning rate at each rung, trained at the rung's budget on seed 0 and judged on "
               "the selection windows (odd windows of the validation split; no reported number uses them); the "
               "other learning rates are the tiny model's tuned ones. The winner of each rung is run on every seed.")
    takeaway = ((f"{len(body)} tuning runs; every winner inside its grid." if not edges else
                 f"{len(body)} tuning runs; winners on the grid's edge (to widen): {', '.join(edges)}.")
                if body else "no tuning runs of the scale ladder yet.")
    header = ["rung", "method", "lr_muon", "steps", "selection loss", "val loss", "chosen", "winner"]
    return Table("ladder-tuning", "Scale ladder: learning rates tuned per rung", header, body, caption, takeaway)
