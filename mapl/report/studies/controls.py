"""The control studies (decompose, learned_fixed_4x, frontier, corpus, blocks): why MAPL beats SSN."""
from __future__ import annotations

import statistics
from typing import Sequence

from matplotlib.lines import Line2D

from ..figures import empty_note, new_figure
from ..render import DASH, Plot, Table, fmt, fmt_ci, fmt_delta, fmt_int, fmt_pct, fmt_pm
from ..rows import at_projection_ratio, boundary_mean, budget_steps, rescored_rows, study_groups
from ..stats import paired, summarize, t_interval
from ..style import NEUTRAL, STUDY_ARM_LABELS, bars_handle, bars_text, fmt_ratio, variant_label
from .headline import gap_sentence, pareto_plot, reading, tested_comparisons

__all__ = ["DECOMPOSITION", "DECOMPOSITION_COMPARISONS", "study_summaries", "study_comparisons",
           "paired_body", "PAIRED_HEADER", "decomposition_study", "learned_fixed_study", "frontier_study",
           "corpus_study", "blocks_study", "decomposition_table", "decomposition_paired_table", "learned_fixed_table",
           "corpus_table", "blocks_table", "controls_plot", "study_comparison", "study_configurations",
           "FRONTIER_VARIANTS", "frontier_table", "frontier_plot", "frontier_anchor_study", "frontier_anchor_table"]

NO_RUNS = "no runs of group {} yet (see README, 'Results')."

# (name, variant, model suffix): the decomposition's configurations; "" is the main model itself, "[*]" the
# main model with any shape overrides (the parameter-matched control: params.yaml says which).
DECOMPOSITION = (("none", "none", ""), ("none+anchors", "none-anchor-factorized", ""), ("ssn", "ssn", ""),
                 ("ssn+anchors", "ssn-anchor-factorized", ""),
                 ("ssn+anchors, matched", "ssn-anchor-factorized", "[*]"),
                 ("mapl-fixed-shared", "mapl-fixed-shared", ""), ("mapl", "mapl", ""))
# (A, B, what the difference isolates), read A − B (positive: B ahead)
DECOMPOSITION_COMPARISONS = (
    ("ssn", "mapl", "the gap to explain"),
    ("ssn", "ssn+anchors", "what MAPL's anchors add to SSN"),
    ("ssn+anchors", "mapl", "what is left once SSN has the anchors"),
    ("ssn+anchors, matched", "mapl", "the same at MAPL's parameter count"),
    ("ssn+anchors", "mapl-fixed-shared", "SSN's writer constraint (both: one fixed subspace + anchors)"),
    ("mapl-fixed-shared", "mapl", "per-boundary learned subspaces against one shared fixed one"),
    ("none", "none+anchors", "the anchors' capacity without compression"),
)


def _group_budget(rows: Sequence[dict], group: str) -> tuple[str | None, int | None, list[int]]:
    """(base model, steps, seeds) of a group's runs at its budget; (None, None, []) without runs."""
    mine = [r for r in rows if r["group"] == group]
    if not mine:
        return None, None, []
    steps = budget_steps(rows, group)
    mine = [r for r in mine if r["steps"] == steps]
    return mine[0]["base_model"], steps, sorted({r["seed"] for r in mine})


def _group_ratio(rows: Sequence[dict], group: str) -> float | None:
    """The one projection ratio of a group's compressed runs."""
    ratios = {r["projection_ratio"] for r in rows if r["group"] == group and r["projection_ratio"] is not None}
    if len(ratios) > 1:
        raise ValueError(f"group {group}: compressed runs at several projection ratios {sorted(ratios)}; a study "
                         f"compares its configurations at one")
    return next(iter(ratios), None)


def study_summaries(rows: Sequence[dict], configs: Sequence[tuple], model: str, steps: int, seeds: Sequence[int],
                    stages: int | None = None, data_source: str | None = None,
                    ratio: float | None = None) -> dict[str, dict]:
    """name -> summary of each configuration (name, variant, model suffix) at ``steps`` on ``seeds``, whichever
    group trained it; ``ratio``: compressed runs at this projection ratio only."""
    out = {}
    at_ratio = at_projection_ratio(rows, ratio)
    for name, variant, suffix in configs:
        # suffix "" is the model itself, "[*]" the model with any shape overrides
        matches = (lambda m: m.startswith(model + "[")) if suffix == "[*]" else (lambda m: m == model + suffix)
        pool = [r for r in at_ratio if r["variant"] == variant and matches(r["model"])
                and r["steps"] == steps and r["seed"] in seeds and (stages is None or r["stages"] == stages)
                and (data_source is None or r.get("data_source", "") == data_source)]
        sums = summarize(pool, rows)
        if sums:
            out[name] = {**sums[0], "name": name}
    return out


def study_comparisons(sums: dict[str, dict], pairs: Sequence[tuple]) -> list[dict]:
    """The paired comparisons (A, B, what) among ``sums`` with a common seed."""
    out = []
    for a, b, what in pairs:
        if a in sums and b in sums:
            p = paired(sums[a]["deltas"], sums[b]["deltas"])
            if p:
                out.append({"a": sums[a], "b": sums[b], "what": what, **p})
    return out


def _name(s: dict) -> str:
    return STUDY_ARM_LABELS.get(s.get("name"), variant_label(s["variant"]))


def _sentence(c: dict) -> str:
    """gap_sentence with the study's arm names."""
    a, b = {**c["a"], "variant": _name(c["a"]), "wire_ratio": None}, {**c["b"], "variant": _name(c["b"]), "wire_ratio": None}
    return gap_sentence({**c, "a": a, "b": b})


def _summary_rows(sums: dict[str, dict], order: Sequence[str]) -> list[list]:
    body = []
    for name in order:
        s = sums.get(name)
        if s is None:
            continue
        none = s["method"] == "none" and s["variant"] == "none"
        body.append([_name(s), s["model"], s["stages"], fmt_ratio(s["wire_ratio"]) if s["method"] != "none" else DASH,
                     fmt(s["total_bytes_per_token"], 1), f"{s['n_params'] / 1e6:.3f}M" if s.get("n_params") else DASH,
                     fmt_int(s["steps"]), ",".join(map(str, s["seeds"])), fmt_pm(s["val_loss"], s["val_loss_std"]),
                     DASH if none else fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True),
                     DASH if none else fmt_ci(t_interval(list(s["deltas"].values())))])
    return body


SUMMARY_HEADER = ["configuration", "model", "P", "wire ratio", "total B/tok", "params", "steps", "seeds", "val loss", "Δ%",
                  "Δ% 95% CI"]


def decomposition_study(rows: Sequence[dict]) -> tuple[dict, list[dict], int | None]:
    model, steps, seeds = _group_budget(rows, "decompose")
    if model is None:
        return {}, [], None
    # the capacity controls may run on more seeds than the decomposition (the parameter-matched control has
    # eight); none, SSN and MAPL of those seeds are the headline's runs, and each comparison pairs on the seeds
    # its two arms share
    _, capacity_steps, capacity_seeds = _group_budget(rows, "decompose_capacity")
    if capacity_steps == steps:
        seeds = sorted(set(seeds) | set(capacity_seeds))
    sums = study_summaries(rows, DECOMPOSITION, model, steps, seeds, ratio=_group_ratio(rows, "decompose"))
    comps = study_comparisons(sums, DECOMPOSITION_COMPARISONS)
    return sums, tested_comparisons(comps, None, len(DECOMPOSITION_COMPARISONS)), steps


def decomposition_table(rows: Sequence[dict]) -> Table:
    """Every configuration of the decomposition with its parameters and bytes."""
    sums, comps, steps = decomposition_study(rows)
    body = _summary_rows(sums, [n for n, _, _ in DECOMPOSITION])
    caption = ("Which ingredient separates MAPL from SSN: each configuration at the headline budget on the "
               "decomposition's seeds (none, SSN and MAPL are the headline's own runs of those seeds). Δ% per "
               "seed against that seed's plain uncompressed run; params: trainable parameters.")
    takeaway = (f"{len(sums)} configurations at {fmt_int(steps)} steps; the paired comparisons are the next table."
                if body else NO_RUNS.format("decompose"))
    return Table("decompose", "Why MAPL beats SSN: the decomposition (group decompose)", SUMMARY_HEADER, body,
                 caption, takeaway)


def paired_body(comps: Sequence[dict], name=_name) -> list[list]:
    """The rows of a study's paired table (:data:`PAIRED_HEADER`), its arms named by ``name``."""
    return [[f"{name(c['a'])} − {name(c['b'])}", c["what"], ",".join(map(str, c["seeds"])),
             ", ".join(f"{d:+.2f}" for d in c["diffs"]), fmt_pm(c["mean"], c["std"], 2),
             fmt_ci(c["ci"]) + (f" ({100 * c['level']:.1f}%)" if c["ci"] else ""),
             DASH if c["p_adj"] is None else f"{c['p_adj']:.3f}", reading(c, name)] for c in comps]


PAIRED_HEADER = ["comparison (A − B)", "isolates", "seeds", "per-seed A − B (points)", "mean ± std", "CI (level)",
                 "Holm p", "reading"]


def decomposition_paired_table(rows: Sequence[dict]) -> Table:
    """The decomposition's paired comparisons, one exploratory family (Holm)."""
    _, comps, steps = decomposition_study(rows)
    caption = ("Differences of Δ% on the same seed (positive: B is ahead), each isolating one ingredient, over the "
               "seeds its two arms share; the seven are one exploratory family, each interval at its Holm-adjusted "
               "level.")
    takeaway = ("; ".join(_sentence(c) for c in comps) + "." if comps else NO_RUNS.format("decompose"))
    return Table("decompose-paired", "Why MAPL beats SSN: paired comparisons (group decompose)",
                 PAIRED_HEADER, paired_body(comps), caption, takeaway)


def _one_contrast_study(rows: Sequence[dict], group: str, configs: Sequence[tuple], contrast: tuple,
                        **where) -> tuple[dict, list[dict], int | None]:
    """A group's configurations at its budget and seeds, with one paired contrast (A, B, what)."""
    model, steps, seeds = _group_budget(rows, group)
    if model is None:
        return {}, [], None
    sums = study_summaries(rows, configs, model, steps, seeds, ratio=_group_ratio(rows, group), **where)
    return sums, tested_comparisons(study_comparisons(sums, (contrast,)), None), steps


def learned_fixed_study(rows: Sequence[dict]) -> tuple[dict, list[dict], int | None]:
    return _one_contrast_study(rows, "learned_fixed_4x", (("none", "none", ""), ("mapl-fixed", "mapl-fixed", ""),
                                                          ("mapl", "mapl", "")),
                               ("mapl-fixed", "mapl", "learning the subspace (SPEL)"))


def learned_fixed_table(rows: Sequence[dict]) -> Table:
    """SPEL against the fixed random projector at the paper's ablation ratio (group ``learned_fixed_4x``)."""
    sums, comps, steps = learned_fixed_study(rows)
    body = _summary_rows(sums, ["none", "mapl-fixed", "mapl"])
    caption = ("MAPL with its learned projector (SPEL) and with a fixed random orthonormal one, at the projection "
               "ratio of the paper's ablation (App. C: fixed +1.19 %, SPEL +0.84 % at 150M), paired by seed.")
    takeaway = ("; ".join(_sentence(c) for c in comps) + "." if comps else
                NO_RUNS.format("learned_fixed_4x") if not sums else "no pair with a common seed.")
    return Table("learned-fixed-4x", f"Learned against fixed subspace at 4× ({study_groups('learned_fixed_4x')})",
                 SUMMARY_HEADER, body, caption, takeaway)


# The paper's Figure 1 at the headline budget (group ``frontier``): each method at every projection ratio the group
# trained and at the headline's, summarised on the group's seeds only, so that every point of the frontier rests on
# the same seeds and tokens (the headline's 8x and learned_fixed_4x's MAPL 4x have more seeds than the group)
FRONTIER_VARIANTS = ("ssn", "mapl", "mapl-rvq-scaled")
FRONTIER_COMPARISONS = (("ssn", "mapl"), ("mapl-rvq-scaled", "mapl"))


def frontier_study(rows: Sequence[dict]) -> tuple[list[dict], list[dict], int | None]:
    model, steps, seeds = _group_budget(rows, "frontier")
    if model is None:
        return [], [], None
    ratios = sorted({r["projection_ratio"] for r in rows if r["group"] in ("frontier", "long")
                     and r["steps"] == steps and r["projection_ratio"] is not None})
    sums = list(study_summaries(rows, (("none", "none", ""),), model, steps, seeds).values())
    comps = []
    for ratio in ratios:
        at = study_summaries(rows, tuple((v, v, "") for v in FRONTIER_VARIANTS), model, steps, seeds, ratio=ratio)
        sums += [at[v] for v in FRONTIER_VARIANTS if v in at]
        comps += study_comparisons(at, [(a, b, "") for a, b in FRONTIER_COMPARISONS])
    # one exploratory family over every ratio's comparisons (SSN − MAPL at 8x on these seeds included: the primary
    # contrast is the headline's 8 seeds, read on its own in the ledger)
    return sums, tested_comparisons(comps, None, len(FRONTIER_COMPARISONS) * len(ratios)), steps


def _frontier_takeaway(sums: Sequence[dict]) -> str:
    """Each method's Δ% along its projection ratios: "SSN 4× +1.2%, 8× +3.4%; MAPL ..."."""
    by: dict[str, list] = {}
    for s in sums:
        if s["method"] != "none":
            by.setdefault(s["variant"], []).append(s)
    return "; ".join(variant_label(v) + " " + ", ".join(
        f"{fmt_ratio(s['projection_ratio'])} {fmt_pct(s['delta_pct'])}" for s in sorted(pts, key=lambda s: s["projection_ratio"]))
        for v, pts in by.items()) + " (Δ% at each projection ratio, mean over the group's seeds)."


def frontier_plot(rows: Sequence[dict]) -> Plot:
    """The frontier as :func:`pareto_plot` draws it (file ``pareto-frontier``; bars: the 95 % interval)."""
    return pareto_plot(rows, "frontier", frontier_study(rows)[0], takeaway=_frontier_takeaway)


def _captured(rows: Sequence[dict], s: dict) -> float | None:
    """The boundary energy a configuration's projector keeps, mean over boundaries and its seeds."""
    return boundary_mean([r for r in rows if r["variant"] == s["variant"] and r["model"] == s["model"]
                          and r["steps"] == s["steps"] and r["projection_ratio"] == s["projection_ratio"]
                          and r["seed"] in s["seeds"]], "captured_energy")


# The frontier without the anchor-rank confound (group ``frontier_anchor``): MAPL's anchor rank follows r by default,
# so along the frontier its anchors shrink with the projection. MAPL at the frontier's other ratios with the
# headline's anchor rank, beside SSN and MAPL of those ratios on the same seeds: three comparisons per ratio, one
# exploratory family declared in advance.
FRONTIER_ANCHOR_COMPARISONS = 3


def frontier_anchor_study(rows: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(summaries, comparisons): per ratio of group frontier_anchor, SSN, MAPL and MAPL at the set anchor rank;
    SSN − MAPL, SSN − MAPL (set rank), MAPL (set rank) − MAPL."""
    model, steps, seeds = _group_budget(rows, "frontier_anchor")
    if model is None:
        return [], []
    mine = [r for r in rows if r["group"] == "frontier_anchor"]
    held = sorted({r["variant"] for r in mine})
    sums, comps = [], []
    for ratio in sorted({r["projection_ratio"] for r in mine}):
        at = study_summaries(rows, (("ssn", "ssn", ""), ("mapl", "mapl", ""), *((v, v, "") for v in held)),
                             model, steps, seeds, ratio=ratio)
        sums += list(at.values())
        comps += study_comparisons(at, [("ssn", "mapl", ""), *(("ssn", v, "") for v in held),
                                        *((v, "mapl", "") for v in held)])
    ratios = len({r["projection_ratio"] for r in mine})
    return sums, tested_comparisons(comps, None, FRONTIER_ANCHOR_COMPARISONS * ratios)


def _anchor_reading(comps: Sequence[dict], ratio: float) -> str:
    """At one ratio: SSN − MAPL with MAPL's own anchor rank and with the set one, and what the set rank does."""
    at = [c for c in comps if c["a"]["projection_ratio"] == ratio]
    tied = next((c for c in at if (c["a"]["variant"], c["b"]["variant"]) == ("ssn", "mapl")), None)
    held = next((c for c in at if c["a"]["variant"] == "ssn" and c["b"]["variant"] != "mapl"), None)
    rank = next((c for c in at if c["b"]["variant"] == "mapl" and c["a"]["variant"] != "ssn"), None)
    if not (tied and held and rank):
        return f"{fmt_ratio(ratio)}: not every arm has runs on a common seed yet"
    moves = rank["ci"] is not None and (rank["ci"][0] > 0 or rank["ci"][1] < 0)
    return (f"{fmt_ratio(ratio)}: SSN − MAPL {tied['mean']:+.2f} points {fmt_ci(tied['ci'])} with MAPL's own anchor "
            f"rank, {held['mean']:+.2f} {fmt_ci(held['ci'])} with {variant_label(held['b']['variant'])}; the set rank "
            f"moves MAPL by {rank['mean']:+.2f} {fmt_ci(rank['ci'])} ("
            + ("resolved" if moves else "not resolved") + f", {rank['n']} seeds)")


def frontier_anchor_table(rows: Sequence[dict]) -> Table:
    """Each arm of group frontier_anchor's ratios and the comparisons that say whether anchor capacity or compression
    ends MAPL's lead along the frontier (``frontier-anchor.md``)."""
    sums, comps = frontier_anchor_study(rows)
    header = [SUMMARY_HEADER[0], "proj. d/r", "anchor rank", *SUMMARY_HEADER[4:]]
    body = []
    for s in sums:
        row = _summary_rows({"x": s}, ["x"])[0]
        r = round(s["d_model"] / s["projection_ratio"]) if s.get("d_model") and s["projection_ratio"] else None
        rank = s.get("anchor_rank") or (r if s["method"] == "mapl" else None)
        body.append([row[0], fmt_ratio(s["projection_ratio"]), rank if rank else DASH, *row[4:]])
    ratios = sorted({s["projection_ratio"] for s in sums})
    caption = ("MAPL's anchor rank follows its projection rank r unless set, so along the frontier its anchors shrink "
               "as it compresses more (at d = 128: 32, 16 and 8 at 4×, 8× and 16×). Group frontier_anchor trains "
               "MAPL at the frontier's other ratios with the headline's (8×) anchor rank, on the frontier's seeds; "
               "beside it SSN and MAPL of the frontier at the same ratio and seeds. Δ% per seed against that seed's "
               "uncompressed run. Comparisons (points; positive: the second ahead): SSN − MAPL, SSN − MAPL at the "
               "set rank, and MAPL at the set rank − MAPL, one exploratory family at Holm's levels. If MAPL's lead "
               "returns at 16× with the larger anchors, anchor capacity ended it there; if not, compression did.")
    takeaway = ("; ".join(_anchor_reading(comps, x) for x in ratios) + "."
                if sums else NO_RUNS.format("frontier_anchor"))
    return Table("frontier-anchor", "The frontier with the anchor rank held", header, body, caption, takeaway)


def frontier_table(rows: Sequence[dict]) -> Table:
    """Every point of the frontier with the energy its projector keeps; the comparisons at each ratio."""
    sums, comps, steps = frontier_study(rows)
    body = []
    for s in sums:
        row = _summary_rows({"x": s}, ["x"])[0]
        body.append([row[0], fmt_ratio(s["projection_ratio"]) if s["projection_ratio"] else DASH, *row[3:4],
                     fmt(s["fwd_bytes_per_token"], 0), *row[4:], fmt(_captured(rows, s), 3)])
    header = [SUMMARY_HEADER[0], "proj. d/r", SUMMARY_HEADER[3], "fwd B/tok", *SUMMARY_HEADER[4:], "captured"]
    caption = ("The paper's Figure 1 at the headline budget: every method at each projection ratio, on the seeds of "
               "group frontier (runs of the same configuration in other groups, on those seeds, are read with it). "
               "Δ% per seed against that seed's plain uncompressed run; its 95 % interval per point. captured: the "
               "share of the boundary activation's energy the projection keeps, mean over boundaries and seeds (SSN's "
               "trunk writes inside its subspace: 1 by construction). The paired comparisons at each ratio (takeaway) "
               "are one exploratory family, each at its Holm-adjusted level.")
    takeaway = ("; ".join(gap_sentence(c) for c in comps) + "." if comps else
                NO_RUNS.format("frontier") if not sums else "no pair with a common seed.")
    held_sums, held_comps = frontier_anchor_study(rows)
    if held_comps:      # whether compression or anchor capacity ends the lead (frontier-anchor.md)
        takeaway += (" With the anchor rank held at the headline's (frontier-anchor.md): "
                     + "; ".join(_anchor_reading(held_comps, x) for x in sorted({s["projection_ratio"] for s in held_sums}))
                     + ".")
    return Table("frontier", f"Loss against compression at the headline budget ({study_groups('frontier')})",
                 header, body, caption, takeaway)


HEADLINE_THREE = (("none", "none", ""), ("ssn", "ssn", ""), ("mapl", "mapl", ""))


def corpus_study(rows: Sequence[dict]) -> tuple[dict, list[dict], int | None]:
    source = next((r.get("data_source", "") for r in rows if r["group"] == "corpus"), None)
    return _one_contrast_study(rows, "corpus", HEADLINE_THREE, ("ssn", "mapl", "the primary contrast on this corpus"),
                               data_source=source)


def _final_train_loss(run: dict, frac: float = 0.1) -> float | None:
    """The mean training loss over the last ``frac`` of the run's steps."""
    curve = run.get("train_loss_curve") or []
    if not curve:
        return None
    tail = [v for s, v in curve if s > run["steps"] * (1 - frac)] or [curve[-1][1]]
    return sum(tail) / len(tail)


UNREAD = "unread-train"    # mapl.orchestration.rescore's set of the training split's windows a run never read


def _sampling_words(pool: Sequence[dict]) -> str:
    """What the last steps' train loss is, from how the runs drew their windows and how much they read."""
    epochs = max((r["tokens"] / r["train_split_tokens"] for r in pool
                  if r.get("tokens") and r.get("train_split_tokens")), default=None)
    read = f"{fmt(epochs, 2)} epochs" if epochs is not None else "an unknown share of the split"
    if pool and all(r.get("data_sampling") == "epochs" for r in pool) and epochs is not None and epochs < 1:
        return (f"Windows are drawn by epochs (each window once per epoch) and the runs read {read}, so no window is "
                "read twice: the train loss is a loss on windows never read before, from the training split's "
                "documents; the validation split is other documents")
    return (f"Windows are drawn with replacement and the runs read {read}, so the train loss of the last steps "
            "mixes windows read before with new ones")


def _penalty_sentence(val: dict, unread: dict | None, stream: list[float]) -> str | None:
    """One configuration's penalties on the validation split, the unread windows and the training stream."""
    if unread is None or not stream or val["delta_pct"] is None or unread["delta_pct"] is None:
        return None
    v, u, t = val["delta_pct"], unread["delta_pct"], statistics.fmean(stream)
    words = (f"{variant_label(val['variant'])} costs {fmt_pct(v)} on the validation split, {fmt_pct(u)} on unread "
             f"training windows (the same checkpoints) and {fmt_pct(t)} on the training stream")
    if abs(t - v) < 0.05:
        return words + ": the three agree"
    return (words + f": the documents scored account for {u - v:+.2f} of the {t - v:+.2f} points between the "
            f"validation split and the training stream, the checkpoint and when the stream is read for the other "
            f"{t - u:+.2f}")


def corpus_table(rows: Sequence[dict], rescores: dict[str, dict] | None = None) -> Table:
    """None, SSN and MAPL on a corpus that does not repeat: validation, training and unread-window Δ%."""
    sums, comps, steps = corpus_study(rows)
    names = [n for n in ("none", "ssn", "mapl") if n in sums]
    runs = {run for n in names for run in sums[n]["runs"]}
    pool = [r for r in rows if r["run"] in runs]
    train = {n: {r["seed"]: t for r in pool if r["run"] in sums[n]["runs"]
                 if (t := _final_train_loss(r)) is not None} for n in names}
    scored = {s["variant"]: s for s in summarize(rescored_rows(pool, rescores or {}, UNREAD))}
    unread = {n: scored[sums[n]["variant"]] for n in names if sums[n]["variant"] in scored}
    # per seed, the training loss's Δ% against the same seed's uncompressed run (under one epoch: a held-out loss)
    ref = train.get("none", {})
    stream = {n: [100 * (train[n][s] - ref[s]) / ref[s] for s in sorted(train[n]) if s in ref] for n in names}
    body = []
    for row, name in zip(_summary_rows(sums, names), names):
        d = stream[name]
        body.append(row + [fmt(statistics.fmean(train[name].values()), 4) if train[name] else DASH,
                           DASH if name == "none" or not d else
                           fmt_pm(statistics.fmean(d), statistics.stdev(d) if len(d) > 1 else None, 2, pct=True)]
                    + ([fmt_delta(unread.get(name)) if name != "none" else DASH] if unread else []))
    source = pool[0].get("data_source") or DASH if pool else DASH    # corpus_study reads one source
    caption = (f"None, SSN and MAPL at the headline's settings on `{source}`, a corpus seen under once in the budget "
               "(the paper's regime; the cpu corpus is seen 3.6 times in 3,000 steps; its size: README, 'Choices "
               f"where the paper is silent'). {_sampling_words(pool)}. Train loss: the mean over the "
               "last 10 % of steps; train Δ%: against the same seed's uncompressed run, mean ± std over seeds."
               + (" Unread Δ%: the checkpoints of the val loss scored on as many windows of the training split as the "
                  "validation split holds, from those the run never read (heldout.md), each seed against its own "
                  "uncompressed run on the same windows: unread windows of the modules training read, where the "
                  "validation split is modules no run read." if unread else ""))
    penalties = [p for n in names if n != "none"
                 if (p := _penalty_sentence(sums[n], unread.get(n), stream[n]))]
    takeaway = ("; ".join(_sentence(c) for c in comps) + "." + "".join(f" {p}." for p in penalties) if comps
                else NO_RUNS.format("corpus"))
    return Table("corpus", "A corpus that does not repeat (group corpus)",
                 SUMMARY_HEADER + ["train loss", "train Δ%"] + (["unread Δ%"] if unread else []), body, caption, takeaway)


def blocks_study(rows: Sequence[dict]) -> tuple[dict, list[dict], int | None]:
    model, steps, seeds = _group_budget(rows, "blocks")
    if model is None:
        return {}, [], None
    stages = sorted({r["stages"] for r in rows if r["group"] == "blocks"})
    ratio = _group_ratio(rows, "blocks")
    sums, comps = {}, []
    for p in stages:
        at_p = {f"{k} P={p}": {**v, "name": k} for k, v in study_summaries(rows, HEADLINE_THREE, model, steps, seeds,
                                                                           stages=p, ratio=ratio).items()}
        sums.update(at_p)
        comps += study_comparisons(at_p, ((f"ssn P={p}", f"mapl P={p}", f"the primary contrast at P = {p}"),))
    return sums, tested_comparisons(comps, None), steps


def blocks_table(rows: Sequence[dict]) -> Table:
    """None, SSN and MAPL with several blocks per stage (group ``blocks``; P = 4 and P = 8)."""
    sums, comps, steps = blocks_study(rows)
    body = _summary_rows(sums, sorted(sums, key=lambda k: (sums[k]["stages"], ["none", "ssn", "mapl"].index(sums[k]["name"]))))
    caption = ("None, SSN and MAPL on a model with several blocks per stage (the paper has 2-4), at P = 4 and "
               "P = 8; an uncompressed run at another P is the reference where its own P has none (the same model "
               "and numbers: P only places the blocks). Every method keeps the learning rates tuned on the main "
               "model; none was retuned for this one. Each projector's boundary geometry is in diagnostics.md (seed 0).")
    takeaway = ("; ".join(f"P = {c['a']['stages']}: " + _sentence(c) for c in comps) + "." if comps
                else NO_RUNS.format("blocks"))
    return Table("blocks", f"Stages of several blocks ({study_groups('blocks')})", SUMMARY_HEADER, body,
                 caption, takeaway)


def _forest_entries(rows: Sequence[dict], corpus_rows: Sequence[dict] | None) -> list[tuple[str, dict]]:
    """(study label, tested comparison) of every study, in the report's order."""
    out = [("decompose", c) for c in decomposition_study(rows)[1]]
    out += [("learned vs fixed, 4×", c) for c in learned_fixed_study(rows)[1]]
    out += [("corpus", c) for c in corpus_study(corpus_rows if corpus_rows is not None else rows)[1]]
    out += [(f"blocks, P = {c['a']['stages']}", c) for c in blocks_study(rows)[1]]
    return out


def controls_plot(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None) -> Plot:
    """Every comparison of the control studies as a forest plot, each interval at its study's Holm level."""
    entries = _forest_entries(rows, corpus_rows)
    fig, (ax,) = new_figure(1, width=7.5, height=max(2.4, 0.42 * len(entries) + 1.2))
    caption = ("Each study's paired comparisons A − B in points of Δ% (positive: B ahead), the mean over seeds with "
               "its interval at the study's Holm-adjusted level (a single seed: a point); dotted line: no difference.")
    if not entries:
        empty_note(ax, "no runs of the control studies yet")
        return Plot("controls", caption, "no runs of the control studies yet.", fig, empty=True)
    for y, (_, c) in enumerate(reversed(entries)):
        lo, hi = c["ci"] if c["ci"] else (c["mean"], c["mean"])
        resolved = c["ci"] is not None and (lo > 0 or hi < 0)
        ax.errorbar([c["mean"]], [y], xerr=[[c["mean"] - lo], [hi - c["mean"]]], fmt="o", capsize=3,
                    color=NEUTRAL["resolved" if resolved else "unresolved"])
    ax.axvline(0, color=NEUTRAL["guide"], linestyle=":", linewidth=1)
    ax.set_yticks(range(len(entries)))
    ax.set_yticklabels([f"{study}: {_name(c['a'])} − {_name(c['b'])}"
                        + (f" [{100 * c['level']:.1f} %]" if c["ci"] and c.get("level") else "")
                        for study, c in reversed(entries)], fontsize=8)
    ax.set_xlabel("A − B, paired difference of Δ%\n(percentage points; > 0: B ahead)")
    fig.suptitle("Control studies: paired comparisons A − B, mean over seeds")
    ax.grid(alpha=0.3, axis="x")
    fig.legend([*(Line2D([], [], ls="none", marker="o", color=NEUTRAL[k]) for k in ("resolved", "unresolved")),
                bars_handle()],
               ["interval excludes 0", "interval includes 0", f"{bars_text('holm')} [level]"],
               loc="outside lower center", ncol=3, fontsize=7)
    resolved = [f"{study}: {_name(c['a'])} − {_name(c['b'])}" for study, c in entries
                if c["ci"] is not None and (c["ci"][0] > 0 or c["ci"][1] < 0)]
    takeaway = (f"{len(resolved)} of {len(entries)} comparisons resolved at their level"
                + (": " + "; ".join(resolved) if resolved else "") + ".")
    return Plot("controls", caption, takeaway, fig)


# the studies the ledger reads: how each is built, and the arm of its contrast ``<arm> − MAPL``
_LEDGER = {"decompose": (decomposition_study, "ssn+anchors"),
           "decompose_capacity": (decomposition_study, "ssn+anchors, matched"),
           "learned_fixed_4x": (learned_fixed_study, "mapl-fixed"), "corpus": (corpus_study, "ssn"),
           "blocks": (blocks_study, "ssn")}


def study_comparison(rows: Sequence[dict], study: str) -> dict | None:
    """The comparison ``<arm> − MAPL`` a study's ledger row reads (blocks: at P = 4); None without it."""
    build, arm = _LEDGER[study]
    return next((c for c in build(rows)[1] if (c["a"]["name"], c["b"]["name"]) == (arm, "mapl")
                 and (study != "blocks" or c["a"]["stages"] == 4)), None)


def study_configurations(rows: Sequence[dict], study: str) -> dict[str, dict]:
    """A study's summaries by configuration name, for the ledger's range claims."""
    return _LEDGER[study][0](rows)[0]

