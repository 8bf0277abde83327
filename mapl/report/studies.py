"""The studies beyond Table 1: the headline at the long budget with paired comparisons, the token
axis (Δ% and the SSN - MAPL gap against training steps) and the width axis.

All use the profile's main model (:func:`mapl.report.rows.main_model`) at the *headline ratio*: the
projection ratio d/r of the MAPL runs of the ``long`` group (without one: 8 if MAPL ran at 8, else
MAPL's most common ratio). Comparisons are paired by seed (:func:`mapl.report.stats.paired`): the
difference of two methods' Δ% on the same seed, in percentage points, positive when the second
method is ahead; its 95% interval is a Student t interval over the seeds.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from . import paper
from .rows import at_best_validation, budget_steps, main_model
from .stats import holm, paired, sign_test_p, summarize, t_interval, t_test_p, wilcoxon_p
from .style import fmt_ratio, label, variant_label
from .table import DASH, Table, fmt, fmt_ci, fmt_int, fmt_pct, fmt_pm
from .tables import NO_RUNS, main_budget

__all__ = ["AXIS_VARIANTS", "STUDY_VARIANTS", "COMPARISONS", "headline_ratio", "headline_summaries", "comparisons",
           "headline_table", "paired_table", "tested_comparisons", "PRIMARY", "runs_table", "token_points", "token_table",
           "width_points", "width_table", "gap_sentence"]

# the variants the token and width axes train (their tables' columns), and the headline's: those and MAPL+VQ with
# its backward message in int8 (compressor.grad_wire)
AXIS_VARIANTS = ("none", "ssn", "mapl", "mapl-fixed", "mapl-rvq", "mapl-rvq-scaled")
STUDY_VARIANTS = (*AXIS_VARIANTS, "mapl-rvq-scaled-grad-int8")
# (A, B): the paired difference Δ%(A) - Δ%(B) at the same projection ratio d/r; the last: what the int8 backward
# costs MAPL+VQ, paired on the seeds both trained
COMPARISONS = (("ssn", "mapl"), ("mapl-fixed", "mapl"), ("mapl-rvq", "mapl"), ("mapl-rvq-scaled", "mapl"),
               ("mapl-rvq-scaled-grad-int8", "mapl-rvq-scaled"))
# The one contrast named before the 8-seed retrain (issue 25): SSN - MAPL at 8x and 3,000 steps, read
# with its plain 95% interval; every other comparison is exploratory, its interval and p Holm-adjusted
# over the exploratory family.
PRIMARY = ("ssn", "mapl")


def headline_ratio(rows: Sequence[dict]) -> float | None:
    """The projection ratio d/r of the headline (see the module docstring)."""
    for pool in ([r for r in rows if r["group"] == "long"], rows):
        ratios = Counter(r["projection_ratio"] for r in pool if r["variant"] == "mapl")
        if ratios:
            return 8 if pool is rows and 8 in ratios else min(ratios, key=lambda x: (-ratios[x], x))
    return None


def _study_pool(rows: Sequence[dict], ratio: float | None, steps: int | None = None, same_model: bool = True):
    model = main_model(rows)
    return [r for r in rows if r["variant"] in STUDY_VARIANTS
            and (r["model"] == model if same_model else r["base_model"] == (model or "").split("[")[0])
            and (steps is None or r["steps"] == steps) and (r["method"] == "none" or r["projection_ratio"] == ratio)]


def headline_summaries(rows: Sequence[dict], group: str = "long") -> list[dict]:
    """Summaries of the main model's runs at the budget of ``group`` (every variant at the headline
    ratio, and the uncompressed run)."""
    model = main_model(rows)
    steps = budget_steps(rows, group, model)
    if steps is None:
        return []
    return summarize(_study_pool(rows, headline_ratio(rows), steps), rows)


def comparisons(sums: Sequence[dict]) -> list[dict]:
    """The paired comparisons of :data:`COMPARISONS` among ``sums`` (same model, P, steps and
    projection ratio): ``a``, ``b`` (summaries) plus the :func:`paired` fields."""
    out = []
    for va, vb in COMPARISONS:
        for a in (s for s in sums if s["variant"] == va):
            b = next((s for s in sums if s["variant"] == vb and s["projection_ratio"] == a["projection_ratio"]
                      and (s["model"], s["stages"], s["steps"]) == (a["model"], a["stages"], a["steps"])), None)
            p = paired(a["deltas"], b["deltas"]) if b else None
            if p:
                out.append({"a": a, "b": b, **p})
    return out


def _name(s: dict) -> str:
    return label(s["variant"], s["wire_ratio"], s["projection_ratio"])


def gap_sentence(c: dict) -> str:
    """"MAPL 8× is 1.20 ± 0.30 points ahead of SSN 8× at 3,000 steps (3 seeds, 95% CI [+0.45, +1.95])"."""
    a, b = c["a"], c["b"]
    lead, lag = (b, a) if c["mean"] >= 0 else (a, b)
    spread = f" ± {c['std']:.2f}" if c["std"] is not None else ""
    level = c.get("level") or 0.95
    ci = f", {100 * level:.3g}% CI {fmt_ci(c['ci'])}" if c["ci"] else ""
    verdict = "" if c["ci"] is None else (" (the interval excludes 0)" if c["ci"][0] > 0 or c["ci"][1] < 0
                                          else " (the interval includes 0: not resolved)")
    return (f"{_name(lead)} is {abs(c['mean']):.2f}{spread} points ahead of {_name(lag)} at {fmt_int(a['steps'])} "
            f"steps ({c['n']} seed{'s' if c['n'] > 1 else ''}{ci}){verdict}")


def _paper_delta(s: dict) -> str:
    if s["variant"] == "mapl-fixed":
        p = next((e for e in paper.paper_ablation("projector") if e["variant"] == "fixed"), None)
        return f"{fmt_pct(p['delta_pct'])} (App. C, {p['scale']}, {fmt_ratio(p['projection_ratio'])})" if p else DASH
    p = paper.paper_match(s["method"], s["projection_ratio"], s["stages"], s["model"])
    if p is None or s["method"] == "none":
        return DASH
    return f"{fmt_pct(p['delta_pct'])} (Table 1, {p['scale']}, P={p['stages']}, {fmt_ratio(p['reported_ratio'])})"


def headline_table(rows: Sequence[dict], group: str = "long") -> Table:
    """The headline at the budget of ``group``: per method mean ± std over seeds of the val loss and
    Δ%, the 95% t interval of Δ% (each seed against its own uncompressed run), the paper beside."""
    sums = headline_summaries(rows, group)
    header = ["method", "proj. d/r", "wire ratio", "total B/tok", "params", "steps", "seeds", "val loss", "Δ%",
              "Δ% 95% CI", "paper Δ%"]
    body = [[variant_label(s["variant"]), fmt_ratio(s["projection_ratio"]), fmt_ratio(s["wire_ratio"]),
             fmt(s["total_bytes_per_token"], 1), f"{s['n_params'] / 1e6:.3f}M" if s.get("n_params") else DASH,
             fmt_int(s["steps"]), ",".join(map(str, s["seeds"])),
             fmt_pm(s["val_loss"], s["val_loss_std"]),
             fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True) if s["method"] != "none" else DASH,
             fmt_ci(t_interval(list(s["deltas"].values()))) if s["method"] != "none" else DASH,
             _paper_delta(s)] for s in sums]
    comps = comparisons(sums)
    if comps:
        takeaway = "; ".join(gap_sentence(c) for c in comps[:2]) + "."
    elif sums:
        takeaway = (f"Δ% at {fmt_int(sums[0]['steps'])} steps: " + "; ".join(
            f"{_name(s)} {fmt_pct(s['delta_pct'])} ({s['n']} seed{'s' if s['n'] > 1 else ''})"
            for s in sums if s["method"] != "none") + "; no pair of methods to compare.")
    else:
        takeaway = NO_RUNS.format(group)
    caption = ("The main model at the long budget, every method on the same tokens and seeds: mean ± sample std over "
               "seeds; Δ% per seed against that seed's uncompressed run, with the Student t 95% interval of its "
               "mean. Paired differences between methods: the next table.")
    return Table("headline", f"Headline at the long budget ({group} group)", header, body, caption, takeaway)


def tested_comparisons(comps: Sequence[dict], primary: tuple | None = PRIMARY, family_size: int | None = None) -> list[dict]:
    """Each comparison with its tests: ``primary`` (the pre-named contrast), ``t_p``, ``wilcoxon_p``,
    ``sign_p`` (exact, two-sided) and the interval it is read with: the plain 95% t interval for the
    primary contrast, a Holm-adjusted one (``level``, ``p_adj``) for the exploratory ones. ``primary``
    None: every comparison is exploratory (one family, as each of issue 26's studies). ``family_size``: the
    exploratory family's declared size, when some of its comparisons may be missing (counted as p = 1)."""
    out = [{**c, "primary": (c["a"]["variant"], c["b"]["variant"]) == primary, "t_p": t_test_p(c["diffs"]),
            "wilcoxon_p": wilcoxon_p(c["diffs"]), "sign_p": sign_test_p(c["diffs"])} for c in comps]
    explore = [c for c in out if not c["primary"]]
    # a family declared in advance keeps its size while some of its comparisons have no runs yet (each absent
    # one counts as p = 1): an interval does not narrow because a group is still to be trained
    absent = [1.0] * max(0, (family_size or 0) - len(explore))
    for c, h in zip(explore, holm([c["t_p"] for c in explore] + absent)):
        c["p_adj"], c["level"] = h["p_adj"], h["level"]
        c["ci"] = t_interval(c["diffs"], h["level"]) if h["level"] else c["ci"]
    for c in out:
        if c["primary"]:
            c["p_adj"], c["level"] = c["t_p"], 0.95
    return out


def _p(p: float | None) -> str:
    return DASH if p is None else f"{p:.3f}" if p >= 0.001 else "<0.001"


def paired_table(rows: Sequence[dict], group: str = "long") -> Table:
    """The paired comparisons at the budget of ``group``: per seed Δ%(A) - Δ%(B), mean ± std, the
    interval it is read with (95% for the primary contrast, Holm-adjusted for the rest), the t,
    Wilcoxon signed-rank and sign tests, and what the interval says."""
    comps = tested_comparisons(comparisons(headline_summaries(rows, group)))
    header = ["comparison (A − B)", "role", "steps", "seeds", "per-seed A − B (points)", "mean ± std", "CI (level)",
              "t p", "Wilcoxon p", "sign p", "reading"]
    body = []
    for c in comps:
        excl = c["ci"] is not None and (c["ci"][0] > 0 or c["ci"][1] < 0)
        ahead = _name(c["b"]) if c["mean"] > 0 else _name(c["a"])
        reading = (DASH if c["ci"] is None else f"{ahead} ahead" if excl else "not resolved")
        level = f" ({100 * c['level']:.1f}%)" if c["ci"] is not None else ""
        role = "primary" if c["primary"] else f"exploratory (Holm p {_p(c['p_adj'])})"
        body.append([f"{_name(c['a'])} − {_name(c['b'])}", role, fmt_int(c["a"]["steps"]),
                     ",".join(map(str, c["seeds"])), ", ".join(f"{d:+.2f}" for d in c["diffs"]),
                     fmt_pm(c["mean"], c["std"], 2), fmt_ci(c["ci"]) + level, _p(c["t_p"]), _p(c["wilcoxon_p"]),
                     _p(c["sign_p"]), reading])
    caption = ("Differences of Δ% between two methods on the same seed (positive: B is ahead), their mean ± sample "
               "std and a Student t interval of the mean. The primary contrast (SSN − MAPL, named before the "
               "8-seed retrain) is read at 95%; the exploratory ones at Holm-adjusted levels over their family. "
               "p values: two-sided one-sample t, exact Wilcoxon signed-rank, exact sign test.")
    takeaway = ("; ".join(gap_sentence(c) for c in comps) + "." if comps else
                f"no pair of methods with a common seed in group {group}." if headline_summaries(rows, group)
                else NO_RUNS.format(group))
    return Table("headline-paired", f"Paired comparisons at the long budget ({group} group)", header, body, caption,
                 takeaway)


def runs_table(rows: Sequence[dict], group: str = "long") -> Table:
    """Every run of the headline methods at the long budget, one line per seed: final and best
    validation loss, and the scale of the residual stream at the boundaries (a run that blows up
    shows there before its loss does)."""
    steps, ratio = budget_steps(rows, group, main_model(rows)), headline_ratio(rows)
    # at the headline's ratio: a study at another ratio and the same budget (learned_fixed_4x) is not the headline
    pool = sorted(_study_pool(at_best_validation(rows), ratio, steps) if steps else [],
                  key=lambda r: (STUDY_VARIANTS.index(r["variant"]), r["seed"]))
    header = ["method", "seed", "final val loss", "best val loss", "best at step", "max boundary RMS",
              "codebook batch perplexity (min)", "largest max |z| (boundary)", "first outlier warning"]
    body, rms = [], {}
    for r in pool:
        scale = max((d.get("activation_rms") or 0 for d in r["boundary_diagnostics"]), default=None)
        rms[r["run"]] = scale
        body.append([variant_label(r["variant"]), r["seed"], fmt(r["final_val_loss"]), fmt(r["val_loss"]),
                     fmt_int(r["best_step"]), fmt(scale, 1) if scale else DASH,
                     fmt(r["codebook_batch_perplexity"], 0) if r["codebook_batch_perplexity"] else DASH,
                     *_health_cells(r)])
    caption = (f"Each run of the headline methods at the {fmt_int(steps)}-step budget"
               + (f" and the headline's projection ratio ({fmt_ratio(ratio)})" if ratio else "")
               + ": the final and the lowest validation loss (at which "
               "evaluation step), the largest RMS of the residual stream entering a boundary (held-out tokens, after "
               "training), for MAPL+VQ the lowest batch perplexity of its codes over boundaries (of 256) and, where "
               "the run recorded its boundary health (runs trained since the early warning; 'not recorded' before), "
               "the largest max |z| of a training message over the run and the step of the first outlier warning "
               "(a window's max |z| above train.health_warn_factor x the median of every earlier reading, readings "
               "in the first 3 warmups not judged).")
    return Table("runs-long", f"Every run at {fmt_int(steps)} steps: final and best loss, activation scale", header,
                 body, caption, _runs_takeaway(pool, rms) if body else NO_RUNS.format(group))


def _health_cells(r: dict) -> list[str]:
    if not r.get("health_recorded"):
        return ["not recorded", "not recorded"]
    peak = f"{fmt(r['max_abs_z_peak'], 1)} (b{r['max_abs_z_boundary']})"
    return [peak, fmt_int(r["first_warning_step"]) if r["first_warning_step"] is not None else "none"]


def _runs_takeaway(pool: Sequence[dict], rms: dict) -> str:
    scales = sorted(v for v in rms.values() if v)
    typical = scales[len(scales) // 2] if scales else None
    blown = [r for r in pool if typical and rms[r["run"]] and rms[r["run"]] > 100 * typical]
    late = [r for r in pool if r["final_val_loss"] > r["val_loss"] * 1.01]
    parts = [f"median of the largest boundary RMS over runs {fmt(typical, 1)}"] if typical else []
    parts += [f"{variant_label(r['variant'])} seed {r['seed']}: RMS {fmt(rms[r['run']], 0)}, final val loss "
              f"{fmt(r['final_val_loss'])} against its best {fmt(r['val_loss'])} at step {fmt_int(r['best_step'])}"
              for r in blown]
    if late and not blown:
        parts += [f"{len(late)} run(s) end more than 1% above their best validation loss"]
    return "; ".join(parts) + "." if parts else "every run ends at its best validation loss."


def token_points(rows: Sequence[dict]) -> list[dict]:
    """Per step count of the main model at the headline ratio: ``steps``, ``tokens``, ``sums``
    (variant -> summary) and ``gap`` (the paired SSN - MAPL comparison, or None)."""
    pool = _study_pool(rows, headline_ratio(rows))
    out = []
    for steps in sorted({r["steps"] for r in pool}):
        sums = {s["variant"]: s for s in summarize([r for r in pool if r["steps"] == steps], rows)}
        if "none" not in sums or len(sums) < 2:
            continue
        gap = next((c for c in comparisons(list(sums.values())) if c["a"]["variant"] == "ssn"), None)
        out.append({"steps": steps, "tokens": sums["none"]["tokens"], "sums": sums, "gap": gap,
                    "eval_set": _eval_sets([r for r in pool if r["steps"] == steps])})
    return out


def _eval_sets(runs: Sequence[dict]) -> str:
    return " + ".join(sorted({r.get("eval_set", "") for r in runs}))


def _eval_set_note(points: Sequence[dict], what: str = "budgets", name=lambda p: f"{fmt_int(p['steps'])} steps") -> str:
    """A warning when the points of an axis were measured on different validation sets (a retrain under way);
    ``name(point)`` names a point ("300 steps", "d = 64")."""
    sets = dict.fromkeys(p["eval_set"] for p in points)
    if len(sets) < 2:
        return ""
    where = "; ".join(f"{s}: {', '.join(name(p) for p in points if p['eval_set'] == s)}" for s in sets)
    return (f" The {what} were evaluated on different validation sets ({where}): each Δ% compares runs on the "
            f"same set, but the trend across sets is not like for like.")


def _delta_cell(s: dict | None) -> str:
    return DASH if s is None else fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True) + f" (n={s['n']})"


def _gap_trend(points: Sequence[dict], where) -> str:
    """The SSN - MAPL gap along an axis; ``where(point)`` names a point ("3,000 steps", "d = 64")."""
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
    """The token axis: each method's Δ% and the paired SSN - MAPL gap at every training budget of
    the main model (groups main, tokens, long). ``best``: at each run's best validation loss
    (:func:`mapl.report.rows.at_best_validation`) instead of its final one; ``train_tokens``: the
    training split's size, for an epochs column."""
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
    """Where the uncompressed runs of ``point`` (the longest budget) had their best validation loss."""
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
    """Per width d of the main model's family at its main budget and the headline ratio: ``d``,
    ``sums`` (variant -> summary) and ``gap`` (paired SSN - MAPL, or None)."""
    model = main_model(rows)
    steps = main_budget(rows, model) if model else None
    pool = _study_pool(rows, headline_ratio(rows), steps, same_model=False)
    out = []
    for d in sorted({r["d_model"] for r in pool if r["d_model"]}):
        sums = {s["variant"]: s for s in summarize([r for r in pool if r["d_model"] == d], rows)}
        if "none" not in sums or len(sums) < 2:
            continue
        gap = next((c for c in comparisons(list(sums.values())) if c["a"]["variant"] == "ssn"), None)
        out.append({"d": d, "steps": steps, "sums": sums, "gap": gap,
                    "eval_set": _eval_sets([r for r in pool if r["d_model"] == d])})
    return out


def width_table(rows: Sequence[dict]) -> Table:
    """The width axis: Δ% and the SSN - MAPL gap at each width d (group width, plus the main model)."""
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
