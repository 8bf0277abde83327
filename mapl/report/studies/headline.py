"""The headline at the long budget (group long), at the headline ratio: Δ%, paired comparisons, runs, figures."""
from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from .. import paper
from ..figures import gap_curves_figure, paper_scatter_figure, pareto_figure
from ..render import DASH, Plot, Table, fmt, fmt_ci, fmt_int, fmt_pct, fmt_pm
from ..rows import at_best_validation, budget_steps, main_model
from ..stats import holm, paired, sign_test_p, summarize, t_interval, t_test_p, wilcoxon_p
from ..style import BARS, figure_label, fmt_ratio, label, variant_label
from .main_budget import NO_RUNS, table1_summaries

__all__ = ["AXIS_VARIANTS", "STUDY_VARIANTS", "COMPARISONS", "PRIMARY", "headline_ratio", "study_pool",
           "headline_summaries", "comparisons", "tested_comparisons", "reading", "gap_sentence", "headline_table", "paired_table",
           "runs_table", "pareto_plot", "gap_curves_plot", "paper_scatter_plot"]

# the variants the token and width axes train (their tables' columns), and the headline's: those and MAPL+VQ with
# its backward message in int8 (compressor.grad_wire)
AXIS_VARIANTS = ("none", "ssn", "mapl", "mapl-fixed", "mapl-rvq", "mapl-rvq-scaled")
STUDY_VARIANTS = (*AXIS_VARIANTS, "mapl-rvq-scaled-grad-int8")
# (A, B): the paired difference Δ%(A) - Δ%(B) at the same projection ratio d/r; the last: what the int8 backward
# costs MAPL+VQ, paired on the seeds both trained
COMPARISONS = (("ssn", "mapl"), ("mapl-fixed", "mapl"), ("mapl-rvq", "mapl"), ("mapl-rvq-scaled", "mapl"),
               ("mapl-rvq-scaled-grad-int8", "mapl-rvq-scaled"))
# the one contrast named before the 8-seed retrain: SSN - MAPL at 8x and 3,000 steps, read with its plain 95%
# interval; every other comparison is exploratory, its interval and p Holm-adjusted over the exploratory family
PRIMARY = ("ssn", "mapl")


def headline_ratio(rows: Sequence[dict]) -> float | None:
    """The headline's projection ratio: that of group long's MAPL runs (else 8 if MAPL ran at 8, else its most common)."""
    for pool in ([r for r in rows if r["group"] == "long"], rows):
        ratios = Counter(r["projection_ratio"] for r in pool if r["variant"] == "mapl")
        if ratios:
            return 8 if pool is rows and 8 in ratios else min(ratios, key=lambda x: (-ratios[x], x))
    return None


def study_pool(rows: Sequence[dict], ratio: float | None, steps: int | None = None, same_model: bool = True):
    model = main_model(rows)
    return [r for r in rows if r["variant"] in STUDY_VARIANTS
            and (r["model"] == model if same_model else r["base_model"] == (model or "").split("[")[0])
            and (steps is None or r["steps"] == steps) and (r["method"] == "none" or r["projection_ratio"] == ratio)]


def headline_summaries(rows: Sequence[dict], group: str = "long") -> list[dict]:
    """Summaries of the main model's runs at the budget of ``group``, every variant at the headline ratio."""
    model = main_model(rows)
    steps = budget_steps(rows, group, model)
    if steps is None:
        return []
    return summarize(study_pool(rows, headline_ratio(rows), steps), rows)


def comparisons(sums: Sequence[dict]) -> list[dict]:
    """The paired comparisons of :data:`COMPARISONS` among ``sums``: ``a``, ``b`` and the :func:`paired` fields."""
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


def reading(c: dict, name=_name) -> str:
    """What a comparison's interval says: "<the one ahead> ahead", "not resolved", or — without an interval."""
    if c["ci"] is None:
        return DASH
    if c["ci"][0] > 0 or c["ci"][1] < 0:
        return f"{name(c['b']) if c['mean'] > 0 else name(c['a'])} ahead"
    return "not resolved"


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


def _paper_entry(s: dict) -> dict | None:
    """The paper's entry beside a summary: App. C's fixed projector, else Table 1's match."""
    if s["variant"] == "mapl-fixed":
        return next((e for e in paper.paper_ablation("projector") if e["variant"] == "fixed"), None)
    return paper.paper_match(s["method"], s["projection_ratio"], s["stages"], s["model"])


def _paper_delta(s: dict) -> str:
    p = _paper_entry(s)
    if p is None or s["method"] == "none":
        return DASH
    if s["variant"] == "mapl-fixed":
        return f"{fmt_pct(p['delta_pct'])} (App. C, {p['scale']}, {fmt_ratio(p['projection_ratio'])})"
    return f"{fmt_pct(p['delta_pct'])} (Table 1, {p['scale']}, P={p['stages']}, {fmt_ratio(p['reported_ratio'])})"


def headline_table(rows: Sequence[dict], group: str = "long") -> Table:
    """Each method's val loss and Δ% over seeds at the budget of ``group``, with its 95% interval and the paper's."""
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
    """Each comparison with its tests and interval: 95% for the ``primary`` contrast, Holm's level over the
    exploratory family (of ``family_size`` when declared) for the others."""
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
    """The paired comparisons at the budget of ``group``: per seed A − B, the interval, the tests, the reading."""
    comps = tested_comparisons(comparisons(headline_summaries(rows, group)))
    header = ["comparison (A − B)", "role", "steps", "seeds", "per-seed A − B (points)", "mean ± std", "CI (level)",
              "t p", "Wilcoxon p", "sign p", "reading"]
    body = []
    for c in comps:
        level = f" ({100 * c['level']:.1f}%)" if c["ci"] is not None else ""
        role = "primary" if c["primary"] else f"exploratory (Holm p {_p(c['p_adj'])})"
        body.append([f"{_name(c['a'])} − {_name(c['b'])}", role, fmt_int(c["a"]["steps"]),
                     ",".join(map(str, c["seeds"])), ", ".join(f"{d:+.2f}" for d in c["diffs"]),
                     fmt_pm(c["mean"], c["std"], 2), fmt_ci(c["ci"]) + level, _p(c["t_p"]), _p(c["wilcoxon_p"]),
                     _p(c["sign_p"]), reading(c, _name)])
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
    """Every run of the headline methods at the long budget: final and best loss, activation scale, health."""
    steps, ratio = budget_steps(rows, group, main_model(rows)), headline_ratio(rows)
    # at the headline's ratio: a study at another ratio and the same budget (learned_fixed_4x) is not the headline
    pool = sorted(study_pool(at_best_validation(rows), ratio, steps) if steps else [],
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
                     *([f"{fmt(r['max_abs_z_peak'], 1)} (b{r['max_abs_z_boundary']})",
                        fmt_int(r["first_warning_step"]) if r["first_warning_step"] is not None else "none"]
                       if r.get("health_recorded") else ["not recorded", "not recorded"])])
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


def _bytes_takeaway(sums: Sequence[dict], ratio: float | None) -> str:
    """Forward against total bytes of the methods at the headline ratio."""
    picks = [s for s in sums if s["method"] != "none" and s["total_bytes_per_token"] and s["projection_ratio"] == ratio]
    if not picks:
        return "no compressed runs with byte counts."
    parts = [f"{label(s['variant'], s['wire_ratio'], s['projection_ratio'])} {fmt(s['fwd_bytes_per_token'], 0)} → "
             f"{fmt(s['total_bytes_per_token'], 1)}" for s in picks]
    return ("Forward → total bytes per token and boundary: " + "; ".join(parts)
            + ". The total counts the backward gradients, token ids, the projector exchange and codebook sync.")


def pareto_plot(rows: Sequence[dict], group: str | None = None, sums: Sequence[dict] | None = None,
                takeaway: Callable[[Sequence[dict]], str] | None = None) -> Plot:
    """Δ% against bytes per token at the main budget or ``group``'s; ``sums``, ``takeaway``: others to draw."""
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


def _in_run_gap(sums: dict) -> dict:
    """Per evaluation step, the paired SSN − MAPL difference of Δ% over the seeds none, SSN and MAPL all have."""
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
    """variant -> (eval steps, mean over seeds of val loss − the mean train loss since the previous evaluation)."""
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
    """The in-run paired SSN − MAPL gap against step (from the loss curves) and each method's val − train loss."""
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
    """Our Δ% against the paper's for every method and ratio both have (main and headline budgets)."""
    cells, model = [], main_model(rows)
    main = [s for s in table1_summaries(rows) if s["model"] == model]
    for budget, sums in (("main", main), ("long", headline_summaries(rows))):
        for s in sums:
            if s["method"] == "none" or s["delta_pct"] is None:
                continue
            p = _paper_entry(s) if s["variant"] in (s["method"], "mapl-fixed", "mapl-rvq-scaled") else None
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
