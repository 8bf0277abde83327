"""The main (short) budget: Table 1 analog, the ablations, seed spread, boundary geometry, codebook sync."""
from __future__ import annotations

import statistics
from typing import Sequence

from .. import paper
from ..render import DASH, Table, fmt, fmt_int, fmt_pct, fmt_pm
from ..rows import MAPL_DEFAULTS, budget_steps, is_default, main_model, setting_of
from ..stats import summarize
from ..style import fmt_ratio, label, variant_label

__all__ = ["NO_RUNS", "main_budget", "table1_summaries", "table1", "paper_table1_table", "order_sentence",
           "ablation_table", "seed_table", "diagnostics_table", "rvq_sync_table"]

NO_RUNS = "no runs in group {}: nothing to show."


def main_budget(rows: Sequence[dict], model: str) -> int | None:
    """The steps of ``model``'s ``main`` runs (without any: its smallest step count)."""
    return budget_steps(rows, "main", model) or min((r["steps"] for r in rows if r["model"] == model), default=None)


def table1_summaries(rows: Sequence[dict]) -> list[dict]:
    """Every default-configured run at its model's main budget (models with overrides are the width study's)."""
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
    """Table 1 analog: our val loss and Δ% per model, P, method and ratio, the paper's entry beside."""
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
    """Two orderings (ascending Δ%) over the names both have: "the same order" only when they match."""
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
    """The runs of each setting on the seeds all its configurations share (none shared: all of them)."""
    seeds: dict[tuple, dict] = {}
    for r in pool:
        seeds.setdefault(setting_of(r), {}).setdefault(r[field], set()).add(r["seed"])
    shared = {k: set.intersection(*v.values()) for k, v in seeds.items()}
    return [r for r in pool if not shared[setting_of(r)] or r["seed"] in shared[setting_of(r)]]


def ablation_table(rows: Sequence[dict], kind: str) -> Table:
    """MAPL with its projector (App. C) or anchor (App. G) varied at every ``ablations`` setting; the paper's beside."""
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
    """Every configuration with two or more seeds: mean ± sample std, range, Δ%."""
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
    """Per run with a projector (seed 0): captured energy, PCA optimum, principal angles, orthogonality drift."""
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
    """MAPL+VQ with each codebook sync at the settings of group ``rvq_sync``: bytes by kind and the loss."""
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
