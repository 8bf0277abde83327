"""The exhibits a reviewer reads first: the primary contrast by seed, learned vs fixed, where the order holds."""
from __future__ import annotations

from typing import Sequence

from ..claims import CLAIMS, MECHANISMS, MIN_SEEDS, Evidence, at_level, family_levels, order_verdict
from ..figures import empty_note, new_grid
from ..render import DASH, Plot, Table, fmt_ci, fmt_int
from ..rows import budget_steps, main_model
from ..stats import holm, t_interval, t_test_p
from ..style import BARS, NEUTRAL, colour, label
from .axes import token_points, width_points
from .controls import blocks_study, corpus_study
from .headline import comparisons, headline_summaries, tested_comparisons
from .ladder import ladder_rungs

__all__ = ["primary_seeds_plot", "learned_fixed_summary_table", "order_holds_table"]


# ---- the primary contrast, seed by seed --------------------------------------------------------------------------
def primary_seeds_plot(rows: Sequence[dict]) -> Plot:
    """Per seed, SSN's and MAPL's Δ% at the headline budget joined by a line; beside it the paired gap."""
    c = next((c for c in tested_comparisons(comparisons(headline_summaries(rows))) if c["primary"]), None)
    fig, axes = new_grid(1, 2, 7.0, 4.0, gridspec_kw={"width_ratios": [2, 1]})
    ax, gap_ax = axes[0]
    caption = ("The primary contrast seed by seed. Left: each line joins one seed's SSN and MAPL Δ% at the headline "
               "budget (both against that seed's uncompressed run, so the seed's data order cancels). Right: the "
               f"paired SSN − MAPL differences (dots), their mean and its {BARS['ci95']}.")
    if c is None:
        empty_note(ax, "no paired SSN and MAPL runs at the headline budget")
        gap_ax.set_axis_off()
        return Plot("primary-seeds", caption, "no paired runs of the primary contrast yet.", fig, empty=True)
    a, b = c["a"], c["b"]
    for seed in c["seeds"]:
        ax.plot([0, 1], [a["deltas"][seed], b["deltas"][seed]], color=NEUTRAL["guide"], linewidth=1, zorder=1)
    for x, s in ((0, a), (1, b)):
        ax.scatter([x] * c["n"], [s["deltas"][k] for k in c["seeds"]], color=colour(s["variant"]), zorder=2, s=22)
    ax.set_xticks([0, 1], [label(s["variant"], s["wire_ratio"], s["projection_ratio"]) for s in (a, b)])
    ax.set_xlim(-0.4, 1.4)
    ax.set_ylabel("Δ% of validation loss (%)")
    ax.set_title(f"Δ% per seed ({c['n']} seeds)")
    gap_ax.scatter([0] * c["n"], c["diffs"], color=NEUTRAL["fill"], s=14, zorder=2)
    lo, hi = c["ci"] if c["ci"] else (c["mean"], c["mean"])
    gap_ax.errorbar([0.5], [c["mean"]], yerr=[[c["mean"] - lo], [hi - c["mean"]]], fmt="D", capsize=4,
                    color=NEUTRAL["resolved" if lo > 0 or hi < 0 else "unresolved"])
    gap_ax.axhline(0, color=NEUTRAL["guide"], linestyle=":", linewidth=1)
    gap_ax.set_xticks([0, 0.5], ["seeds", "mean"])
    gap_ax.set_xlim(-0.5, 1.0)
    gap_ax.set_ylabel("SSN − MAPL (points; > 0: MAPL ahead)")
    gap_ax.set_title("paired gap")
    fig.suptitle(f"Primary contrast at {fmt_int(a['steps'])} steps")
    ahead = sum(a["deltas"][s] > b["deltas"][s] for s in c["seeds"])
    takeaway = (f"MAPL below SSN on {ahead} of {c['n']} seeds; SSN − MAPL {c['mean']:+.2f} points, 95% interval "
                f"{fmt_ci(c['ci'])}.")
    return Plot("primary-seeds", caption, takeaway, fig)


def _signed(c: dict) -> str:
    """``+0.17 ± 0.55``: a paired mean and the sd over seeds (the mean alone for one seed)."""
    return f"{c['mean']:+.2f}" + (f" ± {c['std']:.2f}" if c.get("std") is not None else "")


# ---- learned against fixed, every setting ------------------------------------------------------------------------
_SETTINGS = {"headline's 8×": ("joint training", "headline-paired.md"),
             "ablation's 4×": ("joint training", "learned-fixed-4x.md"),
             "frozen trunk": ("frozen trunk: only A_p and the anchors train", "frozen-trunk-paired.md")}


def learned_fixed_summary_table(rows: Sequence[dict], frozen_rows: Sequence[dict] | None = None) -> Table:
    """fixed − learned (SPEL) in every setting we measured, at its level and verdict in the ledger."""
    ev = Evidence(rows, None, frozen_rows)
    specs = []
    for ledger in (CLAIMS, MECHANISMS):        # the paper's claim under joint training; the frozen trunk's mechanism
        measured = [spec.reads(ev) for spec in ledger]
        levels = family_levels(ledger, measured)
        specs += [(spec, at_level(measured[i], levels[i][0])) for i, spec in enumerate(ledger)
                  if "beats a fixed random one" in spec.claim]
    body = []
    for spec, c in specs:
        training, table = next(v for k, v in _SETTINGS.items() if k in spec.claim)
        if c is None:
            body.append([training, DASH, DASH, DASH, DASH, DASH, "not run", table])
            continue
        verdict = order_verdict(c, spec.paper().size).verdict
        body.append([training, f"{c['a'].get('projection_ratio') or c['a']['ratio']:g}×", fmt_int(c["a"]["steps"]),
                     ",".join(map(str, c["seeds"])), _signed(c),
                     fmt_ci(c["ci"]) + (f" ({100 * c['level']:.3g}%)" if c["ci"] else ""), verdict, table])
    caption = ("The paired difference fixed − learned of Δ% (points; positive: the learned subspace ahead) under joint "
               "training, where the model co-adapts to its boundaries, and on a trained, frozen trunk, where only the "
               "projectors and the anchors train. The joint-training rows are one family (the paper's claim, App. "
               "C), the frozen-trunk row a mechanism study in its own family (mechanisms.md): each interval at its "
               "Holm level; verdict: the claims ledger's rule, with the paper's lead of "
               f"{specs[0][0].paper().size or 0.0:g} points as the size where it applies.")
    joint = [b for b in body if b[0] == "joint training" and b[6] != "not run"]
    frozen = next((b for b in body if b[0].startswith("frozen") and b[6] != "not run"), None)
    takeaway = ("Joint training: " + ("; ".join(f"{b[1]} {b[4]} points {b[5]}: {b[6]}" for b in joint) or "no runs")
                + ". Frozen trunk: " + (f"{frozen[1]} {frozen[4]} points {frozen[5]}: {frozen[6]}" if frozen
                                        else "no runs") + ".")
    header = ["training", "ratio", "steps", "seeds", "fixed − learned (points)", "interval (level)", "verdict", "table"]
    return Table("learned-vs-fixed", "Learned against fixed projectors, every setting", header, body, caption, takeaway)


# ---- where the SSN − MAPL order holds ----------------------------------------------------------------------------
def _entries(rows: Sequence[dict], corpus_rows: Sequence[dict] | None) -> list[tuple[dict, dict]]:
    """(setting, comparison SSN − MAPL) of every model, budget, corpus and P with both methods."""
    model = main_model(rows)
    long_steps = budget_steps(rows, "long", model)
    out = []
    for p in token_points(rows):
        if p["gap"]:
            primary = p["steps"] == long_steps
            out.append(({"model": model, "corpus": "Shakespeare", "P": p["gap"]["a"]["stages"], "primary": primary,
                         "what": "the headline (primary contrast)" if primary else "the token axis"}, p["gap"]))
    for p in width_points(rows):
        if p["gap"] and p["gap"]["a"]["model"] != model:
            a = p["gap"]["a"]                # a width variant: "tiny, d = 64"
            out.append(({"model": f"{a['base_model']}, d = {a['d_model']}" if "[" in a["model"] and a.get("d_model")
                         else a["model"], "corpus": "Shakespeare", "P": a["stages"], "primary": False,
                         "what": "the width axis"}, p["gap"]))
    source = corpus_rows if corpus_rows is not None else rows
    for c in corpus_study(source)[1]:
        out.append(({"model": c["a"]["model"], "corpus": "Python (code)", "P": c["a"]["stages"], "primary": False,
                     "what": "a corpus seen under once"}, c))
    for c in blocks_study(rows)[1]:
        out.append(({"model": c["a"]["model"], "corpus": "Shakespeare", "P": c["a"]["stages"],
                     "primary": False, "what": "several blocks per stage"}, c))
    for rung in ladder_rungs(source):            # each rung's gap; the ladder's own primary contrast is its slope
        if rung["gap"]:
            c = rung["gap"]
            out.append(({"model": c["a"]["model"], "corpus": "Python (code)", "P": c["a"]["stages"], "primary": False,
                         "what": "the scale ladder"}, c))
    return out


def _reading(c: dict) -> str:
    if c["n"] < MIN_SEEDS or c["ci"] is None:
        return f"{c['n']} seed{'s' if c['n'] > 1 else ''}: no verdict"
    lo, hi = c["ci"]
    return "MAPL ahead" if lo > 0 else "SSN ahead" if hi < 0 else "not resolved"


def order_holds_table(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None) -> Table:
    """The paired SSN − MAPL gap at every setting with both methods (the others one exploratory Holm family)."""
    entries = _entries(rows, corpus_rows)
    explore = [i for i, (s, c) in enumerate(entries) if not s["primary"] and c["n"] >= MIN_SEEDS]
    levels = {i: h["level"] for i, h in zip(explore, holm([t_test_p(entries[i][1]["diffs"]) for i in explore]))}
    body = []
    for i, (s, c) in enumerate(entries):
        level = 0.95 if s["primary"] else levels.get(i)
        c = {**c, "level": level, "ci": t_interval(c["diffs"], level) if level and c["n"] >= MIN_SEEDS else None}
        body.append([s["what"], s["model"], s["P"], s["corpus"], fmt_int(c["a"]["steps"]), c["n"],
                     _signed(c), fmt_ci(c["ci"]) + (f" ({100 * level:.3g}%)" if c["ci"] else ""),
                     _reading(c)])
    caption = ("The paired SSN − MAPL difference of Δ% (points; positive: MAPL ahead) at 8× projection in every "
               "setting where both methods ran on the same seeds. The primary contrast is read at 95 %; the other "
               "rows with at least 3 seeds are one exploratory family at Holm's levels; fewer seeds give no verdict.")
    counts = {k: sum(b[-1] == k for b in body) for k in ("MAPL ahead", "SSN ahead", "not resolved")}
    takeaway = (f"{len(body)} settings: MAPL ahead in {counts['MAPL ahead']}, SSN ahead in {counts['SSN ahead']}, "
                f"not resolved in {counts['not resolved']}, {len(body) - sum(counts.values())} without a verdict "
                "(fewer than 3 seeds)." if body else "no setting with paired SSN and MAPL runs yet.")
    header = ["setting", "model", "P", "corpus", "steps", "seeds", "SSN − MAPL (points)", "interval (level)", "reading"]
    return Table("order-holds", "Where MAPL's lead over SSN holds", header, body, caption, takeaway)
