"""The token and width axes: each method's Δ% and the paired SSN − MAPL gap at every budget and width."""
from __future__ import annotations

from typing import Sequence

from ..figures import axis_figure
from ..render import DASH, Plot, Table, fmt, fmt_ci, fmt_int, fmt_pm
from ..rows import at_best_validation, main_model
from ..stats import summarize
from ..style import fmt_ratio, variant_label
from .headline import AXIS_VARIANTS, comparisons, headline_ratio, study_pool
from .main_budget import NO_RUNS, main_budget

__all__ = ["token_points", "token_table", "tokens_plot", "width_points", "width_table", "width_plot"]


def _points(rows: Sequence[dict], pool: Sequence[dict], key: str) -> list[dict]:
    """Per value of ``key`` with an uncompressed run: ``sums`` (variant -> summary), ``gap`` (SSN − MAPL) and
    ``eval_set``."""
    out = []
    for x in sorted({r[key] for r in pool if r[key]}):
        mine = [r for r in pool if r[key] == x]
        sums = {s["variant"]: s for s in summarize(mine, rows)}
        if "none" in sums and len(sums) >= 2:
            gap = next((c for c in comparisons(list(sums.values())) if c["a"]["variant"] == "ssn"), None)
            out.append({key: x, "sums": sums, "gap": gap,
                        "eval_set": " + ".join(sorted({r.get("eval_set", "") for r in mine}))})
    return out


def token_points(rows: Sequence[dict]) -> list[dict]:
    """Per step count: ``steps``, ``tokens``, ``sums`` (variant -> summary), ``gap`` (SSN − MAPL) and ``eval_set``."""
    return [{**p, "tokens": p["sums"]["none"]["tokens"]} for p in _points(rows, study_pool(rows, headline_ratio(rows)),
                                                                          "steps")]


def _eval_set_note(points: Sequence[dict], what: str = "budgets", name=lambda p: f"{fmt_int(p['steps'])} steps") -> str:
    """A warning when an axis's points were measured on different validation sets."""
    sets = dict.fromkeys(p["eval_set"] for p in points)
    if len(sets) < 2:
        return ""
    where = "; ".join(f"{s}: {', '.join(name(p) for p in points if p['eval_set'] == s)}" for s in sets)
    return (f" The {what} were evaluated on different validation sets ({where}): each Δ% compares runs on the "
            f"same set, but the trend across sets is not like for like.")


def _delta_cell(s: dict | None) -> str:
    return DASH if s is None else fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True) + f" (n={s['n']})"


def _gap_trend(points: Sequence[dict], where) -> str:
    """The SSN - MAPL gap along an axis; ``where(point)`` names a point."""
    gaps = [(where(p), p["gap"]) for p in points if p["gap"]]
    if not gaps:
        return "no point with both SSN and MAPL runs."
    trend = " → ".join(f"{g['mean']:+.2f} ({name})" for name, g in gaps)
    last_name, last = gaps[-1]
    spread = (f"± {last['std']:.2f} over {last['n']} seeds, 95% CI {fmt_ci(last['ci'])}" if last["ci"]
              else "one seed, no interval")
    return f"SSN − MAPL gap in Δ% points (positive: MAPL ahead): {trend}; at {last_name}: {spread}."


def _study_header(first: str) -> list[str]:
    return [first, "none val loss", *(f"{variant_label(v)} Δ%" for v in AXIS_VARIANTS[1:]), "gap SSN − MAPL",
            "gap 95% CI"]


def _study_row(key_cells: list, p: dict) -> list:
    gap = p["gap"]
    return [*key_cells, fmt_pm(p["sums"]["none"]["val_loss"], p["sums"]["none"]["val_loss_std"]),
            *(_delta_cell(p["sums"].get(v)) for v in AXIS_VARIANTS[1:]),
            fmt_pm(gap["mean"], gap["std"], 2) if gap else DASH, fmt_ci(gap["ci"]) if gap else DASH]


def token_table(rows: Sequence[dict], best: bool = False, train_tokens: int | None = None) -> Table:
    """Each method's Δ% and the SSN - MAPL gap at every budget (``best``: early stopping; ``train_tokens``: epochs)."""
    scored = at_best_validation(rows) if best else list(rows)
    points = token_points(scored)
    ratio = headline_ratio(rows)
    head = _study_header("steps")
    header = head[:1] + ["tokens"] + (["epochs"] if train_tokens else []) + head[1:] + ["eval set"]
    body = [_study_row([fmt_int(p["steps"]), fmt_int(p["tokens"]),
                        *([fmt(p["tokens"] / train_tokens, 1)] if train_tokens else [])], p) + [p["eval_set"]]
            for p in points]
    which = ("each run's lowest validation loss over its evaluation points (early stopping; the reference is the "
             "uncompressed run's own best)" if best else "the final validation loss")
    caption = (f"The main model at projection ratio {fmt_ratio(ratio)} (MAPL+VQ: twice that on the wire) and every "
               f"training budget, on {which}: Δ% mean ± std over seeds (n seeds), and the paired SSN − MAPL "
               f"difference of Δ% (positive: MAPL ahead) with its Student t 95% interval."
               + (" Epochs: training tokens over the training split's tokens." if train_tokens else ""))
    takeaway = (_gap_trend(points, lambda p: f"{fmt_int(p['steps'])} steps") + _eval_set_note(points)
                if len(points) > 1 else "fewer than two budgets with runs: no token axis.")
    if best and points:
        takeaway += " " + _best_step_note(points[-1], scored)
    if best:
        return Table("tokens-best", "Token axis at each run's best validation loss (early stopping)", header, body,
                     caption, takeaway)
    return Table("tokens", "Token axis: Δ% against training budget", header, body, caption, takeaway)


def _best_step_note(point: dict, scored: Sequence[dict]) -> str:
    """Where the longest budget's uncompressed runs had their best validation loss."""
    names = set(point["sums"]["none"]["runs"])
    steps = sorted(r["best_step"] for r in scored if r["run"] in names)
    if not steps:
        return ""
    where = ", ".join(fmt_int(x) for x in steps)
    early = sum(x < point["steps"] for x in steps)
    return (f"At {fmt_int(point['steps'])} steps the uncompressed runs were best at step {where}"
            + (f" ({early} of {len(steps)} before the end: the uncompressed model overfits, so the final-loss table "
               "flatters compression there)." if early else "."))


def width_points(rows: Sequence[dict]) -> list[dict]:
    """Per width d at the main budget: ``d``, ``sums`` (variant -> summary), ``gap`` (SSN - MAPL) and ``eval_set``."""
    model = main_model(rows)
    steps = main_budget(rows, model) if model else None
    pool = study_pool(rows, headline_ratio(rows), steps, same_model=False)
    return [{"d": p["d_model"], "steps": steps, **p} for p in _points(rows, pool, "d_model")]


def width_table(rows: Sequence[dict]) -> Table:
    """Δ% and the SSN - MAPL gap at each width d (group width, plus the main model)."""
    points = width_points(rows)
    ratio = headline_ratio(rows)
    steps = points[0]["steps"] if points else None
    header = ["d", "r"] + _study_header("d")[1:] + ["eval set"]
    body = ([_study_row([p["d"], fmt(p["d"] / ratio, 0) if ratio else DASH], p) + [p["eval_set"]] for p in points]
            if len(points) > 1 else [])
    caption = (f"Models of the main model's depth at widths d, projection ratio {fmt_ratio(ratio)} (rank r = d / "
               f"ratio), at the main budget ({fmt_int(steps)} steps): Δ% mean ± std over seeds (n seeds) and the "
               f"paired SSN − MAPL gap (positive: MAPL ahead).")
    takeaway = (_gap_trend(points, lambda p: f"d = {p['d']}") + _eval_set_note(points, "widths", lambda p: f"d = {p['d']}")
                if len(points) > 1 else NO_RUNS.format("width"))
    return Table("width", "Width axis: Δ% against model width", header, body, caption, takeaway)


def tokens_plot(rows: Sequence[dict], takeaway: str, best: bool = False) -> Plot:
    """The token axis (``takeaway``: the token table's); ``best``: at each run's best validation loss."""
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
