"""The report's tables at the main budget: Table 1 analog, the paper's Table 1, ablations, seed
spread, boundary geometry, RVQ codebook sync, the tuning protocol, and a per-run table.

Each function takes rows (:mod:`mapl.report.rows`) and returns a :class:`~mapl.report.table.Table`
whose takeaway is computed from the numbers in it. The *main budget* of a model is the step count
of its ``main`` group runs; Table 1 pools every seed of a configuration at that budget (``main``
holds seed 0, ``seeds`` the others).
"""
from __future__ import annotations

import statistics
from typing import Sequence

from . import paper
from .rows import MAPL_DEFAULTS, budget_steps, is_default, main_model, setting_of, sort_key, study_role
from .stats import delta_pct, reference_loss, summarize, t_interval
from .style import fmt_ratio, label, variant_label
from .table import DASH, Table, fmt, fmt_ci, fmt_int, fmt_pct, fmt_pm

__all__ = ["main_budget", "table1_summaries", "table1", "paper_table1_table", "ablation_table", "seed_table",
           "diagnostics_table", "rvq_sync_table", "tuning_table", "tuning_score", "lr_check_table", "val_loss_table",
           "order_sentence"]

NO_RUNS = "no runs in group {}: nothing to show."


def main_budget(rows: Sequence[dict], model: str) -> int | None:
    """The steps of ``model``'s ``main`` group runs (without a main group: its smallest step count)."""
    return budget_steps(rows, "main", model) or min((r["steps"] for r in rows if r["model"] == model), default=None)


def table1_summaries(rows: Sequence[dict]) -> list[dict]:
    """Summaries of every default-configured run at its model's main budget (models with shape
    overrides belong to the width study)."""
    models = sorted({r["model"] for r in rows if "[" not in r["model"]})
    budgets = {m: main_budget(rows, m) for m in models}
    pick = [r for r in rows if r["model"] in budgets and is_default(r) and r["steps"] == budgets[r["model"]]]
    return summarize(pick, rows)


def _paper_cells(s: dict) -> list[str]:
    p = paper.paper_match(s["method"], s["projection_ratio"], s["stages"], s["model"])
    if p is None:
        return [DASH] * 3
    return [f"{p['scale']}, P={p['stages']}, {fmt_ratio(p['reported_ratio'])}", f"{p['val_loss']:g}",
            fmt_pct(p["delta_pct"]) if p["method"] != "none" else DASH]


def _mapl_vs_ssn(sums: Sequence[dict], main: str | None = None) -> str:
    """MAPL against SSN at each wire ratio; with several models or P each entry names its own, ``main``'s first."""
    by = {(s["model"], s["stages"], s["method"], s["wire_ratio"]): s for s in sums}
    named = len({(m, p) for m, p, _, _ in by}) > 1
    parts, ahead = [], 0
    for (model, stages, method, ratio), s in sorted(by.items(), key=lambda kv: (kv[0][0] != main, str(kv[0][:3]),
                                                                                kv[0][3] or 0)):
        o = by.get((model, stages, "ssn", ratio))
        if method != "mapl" or o is None or None in (s["delta_pct"], o["delta_pct"]):
            continue
        ahead += s["delta_pct"] < o["delta_pct"]
        parts.append((f"{model} P={stages} " if named else "")
                     + f"{fmt_ratio(ratio)} {fmt_pct(s['delta_pct'])} vs {fmt_pct(o['delta_pct'])}")
    if not parts:
        return "no ratio with both MAPL and SSN runs."
    t1 = paper.paper_table1()
    ssn = {(e["scale"], e["stages"]): e["delta_pct"] for e in t1 if e["method"] == "ssn"}
    pairs = [(e["delta_pct"], ssn.get((e["scale"], e["stages"]))) for e in t1 if e["method"] == "mapl"]
    paper_ahead = sum(o is not None and m < o for m, o in pairs)
    return (f"MAPL vs SSN Δ% at equal wire ratio: {'; '.join(parts)} (MAPL ahead at {ahead} of {len(parts)}); "
            f"the paper's Table 1 has MAPL ahead in {paper_ahead} of {len(pairs)} entries.")


def table1(rows: Sequence[dict]) -> Table:
    """Table 1 analog: per model, P, method and ratio, our mean val loss (± std over seeds) and Δ%,
    with the paper's entry of the same method and projection ratio beside it."""
    header = ["model", "P", "method", "proj. d/r", "wire ratio", "fwd B/tok", "total B/tok", "steps", "seeds",
              "val loss", "Δ%", "paper (scale, P, ratio)", "paper loss", "paper Δ%"]
    sums = table1_summaries(rows)
    body = [[s["model"], s["stages"], variant_label(s["variant"]), fmt_ratio(s["projection_ratio"]),
             fmt_ratio(s["wire_ratio"]), fmt(s["fwd_bytes_per_token"], 0), fmt(s["total_bytes_per_token"], 1),
             s["steps"], s["n"], fmt_pm(s["val_loss"], s["val_loss_std"]),
             fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True) if s["method"] != "none" else DASH,
             *_paper_cells(s)] for s in sums]
    caption = ("Ours: mean over seeds (± sample std) at each model's main budget; Δ% against the uncompressed "
               "run of the same seed. *wire ratio* = 2d / forward bytes per token (MAPL+VQ doubles its "
               "projection ratio d/r); *total B/tok* adds the backward gradients, token ids, projector exchange "
               "and codebook sync, per boundary. Paper: the Table 1 entry with the same method and projection "
               "ratio (uncompressed: P = 4), at our scale when it is one of the paper's, else the smallest scale "
               "with that ratio (CONFIRMED-secondary, reports/paper-numbers.csv).")
    takeaway = _mapl_vs_ssn(sums, main_model(rows)) if sums else NO_RUNS.format("main")
    return Table("table1", "Table 1 analog (main budget)", header, body, caption, takeaway)


def paper_table1_table() -> Table:
    """The paper's Table 1 as the report reads it, with its certainty."""
    header = ["scale", "method", "reported ratio", "proj. d/r", "P", "val loss", "Δ%", "certainty"]
    t1 = paper.paper_table1()
    body = [[e["scale"], variant_label(e["method"]), fmt_ratio(e["reported_ratio"]), fmt_ratio(e["projection_ratio"]),
             e["stages"], f"{e['val_loss']:g}", fmt_pct(e["delta_pct"]) if e["method"] != "none" else DASH,
             e["certainty"]] for e in t1]
    spans = []
    for m in ("mapl", "ssn", "mapl-rvq"):
        d = [e["delta_pct"] for e in t1 if e["method"] == m]
        spans.append(f"{variant_label(m)} {fmt_pct(min(d))} to {fmt_pct(max(d))}")
    takeaway = f"{len(t1)} entries; Δ% of " + ", ".join(spans) + "."
    return Table("paper-table1", "Paper, Table 1", header, body,
                 "Validation loss (Δ% vs uncompressed), token-matched; the reported ratio of MAPL+VQ is twice its "
                 "projection ratio d/r (r = 256 is inferred from d at each scale).", takeaway)


def order_sentence(ours: dict[str, float], theirs: dict[str, float], names: dict[str, str]) -> str:
    """Compare two orderings (ascending Δ%) over the names both have: "same order as the paper's"
    only when they match, else both orders."""
    common = [k for k in ours if k in theirs]
    mine = sorted(common, key=ours.get)
    paper_order = sorted(common, key=theirs.get)
    def show(order, d) -> str:
        return " < ".join(f"{names[k]} {fmt_pct(d[k])}" for k in order)
    if mine == paper_order:
        return f"{show(mine, ours)}: the same order as the paper's."
    return f"ours {show(mine, ours)}; the paper's {show(paper_order, theirs)}: the orders differ."


_SHORT = {"projector": {"fixed": "fixed", "unconstrained": "unconstrained", "spel": "SPEL"},
          "anchor": {"none": "no anchor", "static": "static", "full": "full", "factorized": "factorized"}}
_ABLATION = {"projector": ("projector", "spel", "Appendix C"), "anchor": ("anchor", "factorized", "Appendix G")}


def _on_shared_seeds(pool: Sequence[dict], field: str) -> list[dict]:
    """The runs of each setting on the seeds every configuration (value of ``field``) of that setting has, so that
    the means a setting's order sentence ranks are over the same seeds (the 3,000-step ablations have seeds 0-2,
    SPEL and the fixed projector 0-7); a setting whose configurations share no seed keeps all its runs."""
    seeds: dict[tuple, dict] = {}
    for r in pool:
        seeds.setdefault(setting_of(r), {}).setdefault(r[field], set()).add(r["seed"])
    shared = {k: set.intersection(*v.values()) for k, v in seeds.items()}
    return [r for r in pool if not shared[setting_of(r)] or r["seed"] in shared[setting_of(r)]]


def ablation_table(rows: Sequence[dict], kind: str) -> Table:
    """MAPL with its projector (``kind="projector"``, the paper's Appendix C) or anchor (``"anchor"``,
    Appendix G) varied, the other at MAPL's default; every setting (model, P, d/r, steps) where an
    ``ablations`` run exists; the paper's 150M rows beside."""
    field, default, source = _ABLATION[kind]
    other = "anchor" if field == "projector" else "projector"
    settings = sorted({setting_of(r) for r in rows if r["group"] == "ablations" and r["method"] == "mapl"
                       and r[field] != default and r[other] == MAPL_DEFAULTS[other]}, key=str)
    pool = _on_shared_seeds([r for r in rows if r["method"] == "mapl" and r[other] == MAPL_DEFAULTS[other]
                             and setting_of(r) in settings], field)
    sums = summarize(pool, rows)
    ref = {e["variant"]: e for e in paper.paper_ablation(kind)}
    header = [kind, "model", "P", "proj. d/r", "steps", "seeds", "val loss", "Δ%", "paper loss", "paper Δ%",
              "certainty"]
    body, sentences = [], []
    for setting in settings:
        ours = {s[field]: s for s in sums if setting_of(s) == setting}
        for name, p in ref.items():
            s = ours.get(name)
            cells = [s["n"], fmt_pm(s["val_loss"], s["val_loss_std"]),
                     fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True)] if s else [0, DASH, DASH]
            body.append([f"{name}: {p['label']}", setting[0], setting[1], fmt_ratio(setting[2]), setting[3], *cells,
                         f"{p['val_loss']:g}", fmt_pct(p["delta_pct"]), p["certainty"]])
        deltas = {k: s["delta_pct"] for k, s in ours.items() if s["delta_pct"] is not None}
        names = _SHORT[kind]
        sentences.append(f"{fmt_ratio(setting[2])}, {setting[3]} steps: "
                         + order_sentence(deltas, {k: p["delta_pct"] for k, p in ref.items()}, names))
    p0 = next(iter(ref.values()))
    caption = (f"MAPL with the {field} varied and the {other} at MAPL's default; Δ% against the uncompressed run "
               f"of the same budget and seed, mean ± std over the seeds every row of its setting has. Paper: {source} "
               f"({p0['scale']}, P = {p0['stages']}, {fmt_ratio(p0['projection_ratio'])}).")
    return Table(f"ablation-{kind}", f"Ablation: {kind}", header, body, caption,
                 " ".join(sentences) if sentences else NO_RUNS.format("ablations"))


def seed_table(rows: Sequence[dict]) -> Table:
    """Every configuration with two or more seeds: mean ± sample std, range, Δ% mean ± std."""
    header = ["model", "P", "method", "wire ratio", "steps", "seeds", "val loss (mean ± std)", "min", "max",
              "Δ% (mean ± std)"]
    sums = [s for s in summarize(rows) if s["n"] >= 2]
    body = [[s["model"], s["stages"], variant_label(s["variant"]), fmt_ratio(s["wire_ratio"]), s["steps"],
             ",".join(map(str, s["seeds"])), fmt_pm(s["val_loss"], s["val_loss_std"]), fmt(s["val_loss_min"]),
             fmt(s["val_loss_max"]), fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True) if s["method"] != "none"
             else DASH] for s in sums]
    if sums:
        stds = [s["val_loss_std"] for s in sums]
        dstds = [s["delta_std"] for s in sums if s["delta_std"] is not None]
        takeaway = (f"{len(sums)} configurations with 2+ seeds: the val-loss std is {min(stds):.4f} to {max(stds):.4f} "
                    f"(median {statistics.median(stds):.4f})" + (
                        f"; the Δ% std {min(dstds):.2f} to {max(dstds):.2f} points (median "
                        f"{statistics.median(dstds):.2f}): differences of Δ% below about twice that are not "
                        f"resolved by seeds." if dstds else "."))
    else:
        takeaway = "no configuration has two seeds yet."
    return Table("seeds", "Seed spread", header, body,
                 "Every configuration run with two or more seeds (any budget): sample std and range over seeds.",
                 takeaway)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _geometry(r: dict) -> dict | None:
    diags = [d for d in r.get("boundary_diagnostics") or [] if "captured_energy" in d]
    if not diags:
        return None
    adj = [d["angles_to_next_deg"]["mean"] for d in diags if "angles_to_next_deg" in d]
    return {"rank": diags[0]["rank"], "captured": _mean([d["captured_energy"] for d in diags]),
            "pca": _mean([d["pca_energy"] for d in diags]), "adjacent": _mean(adj),
            "to_pca": _mean([d["angles_to_pca_deg"]["mean"] for d in diags]),
            "ortho": max(d["ortho_err"] for d in diags)}


def _geometry_takeaway(geo: dict) -> str:
    mapl = [(r, g) for r, g in geo.items() if r[0] == "mapl"]
    if not mapl:
        return "no MAPL run with boundary diagnostics."
    # the longest budget, preferring ratios with a fixed-projector run to compare with: one sentence per such
    # ratio (the headline's 8x and the paper's ablation's 4x are both trained at 3,000 steps)
    def rank(key):                                   # (budget, has a fixed-projector twin)
        return key[2], ("mapl-fixed", *key[1:]) in geo
    best = max(rank(k) for k, _ in mapl)
    keys = sorted(k for k, _ in mapl if rank(k) == best)
    learned_p = paper.paper_value("geometry", "captured_energy", variant="spel")
    fixed_p = paper.paper_value("geometry", "captured_energy", variant="fixed")
    adj_p = paper.paper_value("geometry", "principal_angle", variant="adjacent")
    parts = []
    for key in keys:
        _, ratio, steps = key
        g, fixed = geo[key], geo.get(("mapl-fixed", ratio, steps))
        parts.append(f"MAPL {fmt_ratio(ratio)} at {fmt_int(steps)} steps captures {g['captured']:.2f} of the boundary"
                     f" energy" + (f" (fixed projector {fixed['captured']:.2f})" if fixed else "")
                     + f", the best rank-{g['rank']} basis {g['pca']:.2f}"
                     + (f"; adjacent boundaries {g['adjacent']:.0f}° apart" if g["adjacent"] is not None else ""))
    return ("; ".join(parts) + ". "
            f"Paper ({learned_p['scale']}, r = 128, {learned_p['certainty']}): {learned_p['value']:.2f} learned vs "
            f"{fixed_p['value']:.2f} fixed; {adj_p['value']:g}° between adjacent stages.")


def diagnostics_table(rows: Sequence[dict]) -> Table:
    """Per run with a projector (seed 0): captured energy, the PCA optimum at the same rank,
    principal angles between adjacent boundaries and to the PCA subspace, orthogonality drift
    (means over boundaries)."""
    header = ["run", "method", "steps", "r", "captured energy", "PCA energy (best rank-r)", "angle adjacent (°)",
              "angle to PCA (°)", "max |AᵀA−I|"]
    body, geo, model = [], {}, main_model(rows)
    for r in rows:
        g = _geometry(r) if r["seed"] == 0 else None
        if g is None:
            continue
        if r["model"] == model:     # the takeaway's keys name no model: other models' runs (width, blocks) stay rows
            geo[(r["variant"], r["projection_ratio"], r["steps"])] = g
        body.append([r["run"], label(r["variant"], r["wire_ratio"], r["projection_ratio"]), r["steps"], g["rank"],
                     fmt(g["captured"], 3), fmt(g["pca"], 3), fmt(g["adjacent"], 1), fmt(g["to_pca"], 1),
                     f"{g['ortho']:.1e}"])
    caption = ("Captured energy ‖XA‖²/‖X‖² of each boundary's projector on held-out activations (the residual minus "
               "the stage's anchor, what the projector sees), the best any rank-r basis could do (PCA), principal "
               "angles between adjacent boundaries and to the PCA subspace, orthogonality drift; seed 0.")
    return Table("diagnostics", "Boundary geometry (means over boundaries)", header, body, caption,
                 _geometry_takeaway(geo) if body else "no runs with boundary diagnostics.")


def rvq_sync_table(rows: Sequence[dict]) -> Table:
    """MAPL+VQ with each codebook sync (streamed slices, full copies, mirrored codebooks) at the
    settings of the ``rvq_sync`` group: bytes per token by kind and the loss."""
    settings = {setting_of(r) for r in rows if r["group"] == "rvq_sync"}
    pool = [r for r in rows if r["method"] == "mapl-rvq" and r["projector"] == "spel" and r["anchor"] == "factorized"
            and setting_of(r) in settings]
    sums = sorted(summarize(pool, rows), key=lambda s: (str(setting_of(s)), s["variant"]))
    header = ["codebook sync", "proj. d/r", "wire ratio", "steps", "seeds", "fwd B/tok", "codebook sync B/tok",
              "projector B/tok", "total B/tok", "val loss", "Δ%"]
    body = [[s["rvq_sync"], fmt_ratio(s["projection_ratio"]), fmt_ratio(s["wire_ratio"]), s["steps"], s["n"],
             fmt(s["fwd_bytes_per_token"], 1), fmt(s["sync_bytes_per_token"], 2), fmt(s["state_bytes_per_token"], 1),
             fmt(s["total_bytes_per_token"], 1), fmt_pm(s["val_loss"], s["val_loss_std"]),
             fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True)] for s in sums]
    if sums:
        parts = [f"{s['rvq_sync']} {fmt(s['total_bytes_per_token'], 1)} B/tok, Δ% {fmt_pct(s['delta_pct'])}"
                 for s in sums]
        spread = max(s["val_loss"] for s in sums) - min(s["val_loss"] for s in sums)
        takeaway = f"{'; '.join(parts)}: the val losses lie within {spread:.4f} of each other."
    else:
        takeaway = NO_RUNS.format("rvq_sync")
    return Table("rvq-sync", "MAPL+VQ codebook sync", header, body,
                 "Per boundary and training token: forward payload, codebook sync (streamed slices piggybacked "
                 "on the data, or full copies), projector exchange and the total of both directions.", takeaway)


def _cell(r: dict, fields: Sequence[str]) -> tuple:
    return tuple(r.get(f) for f in fields)


_TUNED = ("lr_muon", "lr_embed", "lr_head")


def tuning_score(r: dict) -> float:
    """What a tuning cell is judged on: its selection-set loss (train.select_every), or, for results
    of the old protocol, its validation loss on the tuning slice (train.eval_offset)."""
    return r["select_loss"] if r.get("select_loss") is not None else r["val_loss"]


def _tuning_takeaway(tune: Sequence[dict], rows: Sequence[dict]) -> str:
    parts, unmatched = [], []
    for variant in dict.fromkeys(r["variant"] for r in tune):
        runs = [r for r in tune if r["variant"] == variant]
        best = min(runs, key=tuning_score)
        fields = _TUNED + (("proj_lr_mult",) if best["projector"] else ())
        parts.append(f"{label(variant, best['wire_ratio'])} μ {best['lr_muon']:g}, emb {best['lr_embed']:g} "
                     f"({tuning_score(best):.3f}, best of {len(runs)} cells)")
        main = [r for r in rows if r["group"] == "main" and r["variant"] == variant
                and r["wire_ratio"] == best["wire_ratio"]]
        if main and any(_cell(m, fields) != _cell(best, fields) for m in main):
            used = next((r for r in runs if _cell(r, fields) == _cell(main[0], fields)), None)
            gap = tuning_score(used) - tuning_score(best) if used else 0.0
            unmatched.append(label(variant, best["wire_ratio"]) + (
                f" (their cell μ {used['lr_muon']:g}, emb {used['lr_embed']:g} scored {tuning_score(used):.4f}, "
                f"{gap:+.4f} = {100 * gap / tuning_score(best):+.2f}% behind the best)" if used else ""))
    tail = (f" The main runs of {'; '.join(unmatched)} do not use their best cell." if unmatched
            else " The main runs use each tuned method's best cell.")
    return "Best on the selection tokens: " + "; ".join(parts) + "." + tail


def _scored_on(tune: Sequence[dict]) -> str:
    if tune and all(r.get("select_loss") is not None for r in tune):
        return "the selection set (every second 128-token window of the whole validation split)"
    offset = next((r["eval_offset"] for r in tune if r["eval_offset"]), None)
    return f"validation tokens from {fmt_int(offset)} on (the old tuning slice)" if offset else "the validation split"


def tuning_table(rows_all: Sequence[dict]) -> Table:
    """The tuning protocol (groups ``tune``, ``tune2``; judged on the selection set, which no reported
    number uses): each cell's learning rates and score, the best per method marked. ``rows_all``: rows
    with the tuning groups (``select(..., eval_offset=None, tuning=True)``)."""
    tune = sorted([r for r in rows_all if r["group"] in ("tune", "tune2")],
                  key=lambda r: (sort_key(r)[:5], tuning_score(r)))
    best = {v: min((r for r in tune if r["variant"] == v), key=tuning_score)["run"]
            for v in {r["variant"] for r in tune}}
    header = ["method", "stage", "lr muon", "lr embed", "lr head", "proj. lr mult", "steps", "loss (selection)",
              "best"]
    body = [[label(r["variant"], r["wire_ratio"]), r["group"], r["lr_muon"], r["lr_embed"], r["lr_head"],
             r["proj_lr_mult"] if r["projector"] else DASH, r["steps"], fmt(tuning_score(r)),
             "★" if best[r["variant"]] == r["run"] else ""] for r in tune]
    caption = (f"Stage 1 (``tune``): the same 2 × 2 grid over the Muon and embedding learning rates for every "
               f"method family; stage 2 (``tune2``): one step past the best cell along each knob where it sat on "
               f"the grid's edge, plus one run on a third knob. Judged on {_scored_on(tune)}, which no reported "
               f"number uses.")
    reported = [r for r in rows_all if not r["eval_offset"] and study_role(r["group"]) != "tuning"]
    return Table("tuning", "Tuning protocol", header, body, caption,
                 _tuning_takeaway(tune, reported) if tune else NO_RUNS.format("tune"))


def _spel_step(r: dict) -> float | None:
    """SPEL's projector step multiplier (``compressor.projector.lr_mult``) of a run with a learned projector."""
    return r.get("proj_lr_mult") if r["projector"] == "spel" else None


def _cell_text(r: dict, named: bool = False) -> str:
    """A tuning cell as the lr-check table names it: ``μ, emb`` and, with SPEL, its projector step multiplier;
    ``named``: each value after its name, as a sentence reads it (``μ 0.02, emb 0.03, SPEL ×0.1``)."""
    step = _spel_step(r)
    mu, emb = (f"μ {r['lr_muon']:g}", f"emb {r['lr_embed']:g}") if named else (f"{r['lr_muon']:g}", f"{r['lr_embed']:g}")
    return f"{mu}, {emb}" + (f", SPEL ×{step:g}" if step is not None else "")


def _tuned_runs(rows_all: Sequence[dict], check: dict) -> dict[int, dict]:
    """seed -> the run a check cell is paired with: a reported study's run of the check's configuration (variant,
    model, P, wire ratio, steps) on the report's windows. Reported studies train at the tuned cells (params.yaml
    ``method_overrides``); only tuning studies, lr_check among them, move a learning rate, so which reported study
    holds the run need not be named (the headline's ratio is group long's, the frontier's ratios group frontier's)."""
    def configuration(r: dict) -> tuple:
        return r["variant"], r["model"], r["stages"], r["wire_ratio"], r["steps"]
    return {r["seed"]: r for r in rows_all if study_role(r["group"]) == "reported" and not r["eval_offset"]
            and configuration(r) == configuration(check)}


def lr_check_table(rows_all: Sequence[dict]) -> Table:
    """The budget-matched check of the tuned learning rates (group ``lr_check``): each check run beside
    the tuned run (:func:`_tuned_runs`) of the same configuration and seed, both judged on the
    selection set at the last step; the paired difference check − tuned (negative: the check cell
    is better, and the tuning protocol must rerun at the headline budget). A cell is the Muon and embedding
    LRs and, for a learned projector, SPEL's step multiplier (``compressor.projector.lr_mult``)."""
    checks = [r for r in rows_all if r["group"] == "lr_check"]
    header = ["method", "check cell (μ, emb[, SPEL])", "tuned cell", "steps", "seeds", "check − tuned (selection)",
              "95% CI", "reading"]
    body, sentences = [], []
    def cell_of(r: dict) -> tuple:          # one row per checked cell: a method may be checked at several
        return r["variant"], r["wire_ratio"], r["lr_muon"], r["lr_embed"], _spel_step(r)
    for cell in dict.fromkeys(map(cell_of, checks)):
        variant = cell[0]
        mine = [r for r in checks if cell_of(r) == cell]
        tuned = _tuned_runs(rows_all, mine[0])
        pairs = [(r, tuned[r["seed"]]) for r in mine if r["seed"] in tuned]
        diffs = [tuning_score(a) - tuning_score(b) for a, b in pairs]
        ci = t_interval(diffs)
        worse = ci is not None and ci[0] > 0
        better = ci is not None and ci[1] < 0
        reading = ("tuned cell better" if worse else "check cell better: retune at this budget" if better
                   else "not resolved" if ci else DASH)
        name = label(variant, mine[0]["wire_ratio"])
        t0 = pairs[0][1] if pairs else None
        body.append([name, _cell_text(mine[0]), _cell_text(t0) if t0 else DASH, fmt_int(mine[0]["steps"]),
                     ",".join(str(a["seed"]) for a, _ in pairs),
                     fmt_pm(statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else None, 4)
                     if diffs else DASH, fmt_ci(ci, 4) if ci else DASH, reading])
        if diffs:
            sentences.append(f"{name} at {_cell_text(mine[0], named=True)}: {reading} ({len(diffs)} seeds)")
    caption = ("Each method at another cell (the other method's winning knob; SSN also at the step past its "
               "300-step winner; MAPL also at SPEL's projector step multiplier on each side of its tuned one; at "
               "16×, SSN and MAPL at half and twice the Muon LR tuned at 8×), at the headline budget, against its "
               "tuned run of the same ratio and seed (group long; at 4× and 16× group frontier); losses on the "
               "selection set at the last step.")
    return Table("lr-check", "Budget-matched learning-rate check", header, body, caption,
                 "; ".join(sentences) + "." if sentences else NO_RUNS.format("lr_check"))


def val_loss_table(rows: Sequence[dict]) -> tuple[list, list]:
    """Per run: run, method, wire ratio, projector, anchor, seed, steps, val loss, Δ% (vs the
    uncompressed run among ``rows``, if any): ``(header, body)`` for :func:`to_markdown`."""
    header = ["run", "method", "wire ratio", "projector", "anchor", "seed", "steps", "val loss", "Δ%"]
    body = [[r["run"], variant_label(r["method"]), fmt_ratio(r["wire_ratio"]), r["projector"] or DASH, r["anchor"],
             r["seed"], r["steps"], fmt(r["val_loss"]),
             fmt_pct(delta_pct(r["val_loss"], reference_loss(rows, r))) if r["method"] != "none" else DASH]
            for r in sorted(rows, key=sort_key)]
    return header, body
