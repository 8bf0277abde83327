"""The claims ledger: each claim of the paper beside what we measured, and a verdict (rules: docs/protocol.md)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Sequence

from . import paper
from .render import DASH, Table, fmt_ci, fmt_int, fmt_pct
from .rows import MAPL_DEFAULTS, main_model, setting_of, study_role
from .stats import holm, paired, summarize, t_interval, t_test_p
from .studies.axes import width_points
from .studies.controls import study_comparison, study_configurations
from .studies.frozen import frozen_comparison
from .studies.headline import comparisons, headline_summaries, tested_comparisons
from .studies.ladder import ladder_slope_comparison
from .style import variant_label

__all__ = ["VERDICTS", "REPRODUCED", "CONTRADICTED", "INCONCLUSIVE", "NOT_TESTABLE", "MIN_SEEDS", "BYTES_REPRODUCED",
           "NOT_RUN", "Ruling", "PaperSide", "range_verdict", "order_verdict", "RULES", "Evidence", "Claim", "CLAIMS",
           "MECHANISMS", "at_level", "family_levels", "evaluate", "claims", "mechanisms", "tally", "claims_table",
           "mechanisms_table"]

VERDICTS = ("reproduced", "contradicted", "inconclusive", "not testable here")
REPRODUCED, CONTRADICTED, INCONCLUSIVE, NOT_TESTABLE = VERDICTS
MIN_SEEDS = 3            # fewer seeds than this: no verdict (an interval on 2 seeds has 1 degree of freedom)
BYTES_REPRODUCED = 1.8   # "RVQ halves the bytes again": reproduced when all bytes fall at least this much
NOT_RUN = "not run: no results of it among the runs"


class Ruling(NamedTuple):
    """A verdict, its reason, and the reason as data (``grounds``: comparable across ledgers of other levels)."""
    verdict: str
    reason: str
    grounds: tuple = ()


class PaperSide(NamedTuple):
    """The paper's cell: for a range claim its bounds (None: open), for an order claim its lead in points (``size``)."""
    text: str
    low: float | None = None
    high: float | None = None
    size: float | None = None


# ---- the rules ---------------------------------------------------------------------------------------------------
def _pct(level: float) -> str:
    return f"{100 * level:.3g}%"


def _untestable(n: int, unit: str) -> Ruling:
    if n == 0:
        return Ruling(NOT_TESTABLE, NOT_RUN, ("not run",))
    return Ruling(NOT_TESTABLE, f"fewer than {MIN_SEEDS} {unit}", ("too few seeds",))


def range_verdict(ci, low: float | None, high: float | None, n: int = MIN_SEEDS, level: float = 0.95) -> Ruling:
    """A claimed range [``low``, ``high``] of Δ% against our interval ``ci`` (read at ``level``)."""
    if ci is None:
        return _untestable(n, "seeds")
    above = high is not None and ci[0] > high
    below = low is not None and ci[1] < low
    if above or below:
        side = "above" if above else "below"
        return Ruling(CONTRADICTED, f"our {_pct(level)} interval lies wholly {side} the claimed range", ("outside", side))
    out_low, out_high = low is not None and ci[0] < low, high is not None and ci[1] > high
    if out_low or out_high:
        bound = "both bounds" if out_low and out_high else "lower bound" if out_low else "upper bound"
        return Ruling(INCONCLUSIVE, (f"our {_pct(level)} interval straddles the claimed range's {bound}: neither "
                                     "inside nor outside it"), ("straddles", bound))
    return Ruling(REPRODUCED, f"our {_pct(level)} interval lies inside the claimed range", ("inside",))


def order_verdict(c: dict | None, size: float | None = None) -> Ruling:
    """The claim "B ahead of A" (by at least ``size`` points where the paper states a lead) against A − B ``c``."""
    if c is None:
        return _untestable(0, "")
    if c["n"] < MIN_SEEDS or c["ci"] is None:
        return _untestable(max(c["n"], 1), "paired seeds")
    low, high = c["ci"]
    interval = f"the paired {_pct(c['level'])} interval"
    sign = "claimed" if low > 0 else "reversed" if high < 0 else "unresolved"
    said = {"claimed": f"sign: {interval} excludes 0 on the claimed side",
            "reversed": f"sign: {interval} excludes 0 on the other side (the order is reversed)",
            "unresolved": f"sign: {interval} includes 0 (the order is not resolved)"}[sign]
    grounds = ("sign", sign)
    if size is not None:
        lead = "short" if high < size else "above" if low > size else "includes"
        said += {"short": f"; size: it lies wholly below the claimed lead of {size:g} points",
                 "above": f"; size: it lies above the claimed lead of {size:g} points",
                 "includes": f"; size: it includes the claimed lead of {size:g} points"}[lead]
        grounds += ("size", lead)
    verdict = CONTRADICTED if sign == "reversed" or grounds[-1] == "short" else \
        REPRODUCED if sign == "claimed" else INCONCLUSIVE
    return Ruling(verdict, said, grounds)


def _delta_cell(s: dict | None, level: float = 0.95) -> tuple[str, object]:
    if s is None or s["delta_pct"] is None:
        return DASH, None
    ci = t_interval(list(s["deltas"].values()), level) if s["n"] >= MIN_SEEDS else None
    shown = f"{_pct(level)}, " if ci and level != 0.95 else ""
    return (f"{fmt_pct(s['delta_pct'])} {fmt_ci(ci)} ({shown}n = {s['n']}, {fmt_int(s['steps'])} steps, "
            f"{s['wire_ratio']:g}× on the wire, {s['total_bytes_per_token']:.1f} B/token in all)"), ci


def _comparison_cell(c: dict | None) -> str:
    if c is None:
        return DASH
    # one seed has no interval and no test level (Holm leaves it out): the cell says n and the budget only
    level = f"{_pct(c['level'])}, " if c.get("level") is not None and c.get("ci") else ""
    return f"{c['mean']:+.2f} points {fmt_ci(c['ci'])} ({level}n = {c['n']}, {fmt_int(c['a']['steps'])} steps)"


def range_row(claim: Claim, side: PaperSide, s: dict | None, level: float = 0.95) -> tuple[str, Ruling]:
    """A claimed range of Δ%, read from one configuration's summary ``s``."""
    cell, ci = _delta_cell(s, level)
    name = variant_label(s["variant"]) if claim.label_measured and s else claim.label
    return f"{name}: {cell}", range_verdict(ci, side.low, side.high, s["n"] if s else 0, level)


def order_row(claim: Claim, side: PaperSide, c: dict | None, level: float = 0.95) -> tuple[str, Ruling]:
    """A claimed order "B ahead of A", read from the comparison A − B (already at the family's level)."""
    return f"{claim.label}: {_comparison_cell(c)}", order_verdict(c, side.size)


def bytes_row(claim: Claim, side: PaperSide, pair: tuple[dict | None, dict | None], level: float = 0.95):
    """All bytes per token of MAPL over the compressed variant's (a count, no interval); no row without both."""
    s, m = pair
    if s is None or m is None:
        return None
    fwd = m["fwd_bytes_per_token"] / s["fwd_bytes_per_token"]
    total = m["total_bytes_per_token"] / s["total_bytes_per_token"]
    unquantised = ("the token ids are not quantised, the gradient is int8 (MAPL's: bf16)"
                   if s["variant"].endswith("-grad-int8") else "the gradient and the token ids are not quantised")
    enough = total >= BYTES_REPRODUCED
    reason = (f"all bytes (both directions, token ids, projector and codebook exchange) fall {total:.2f}×: "
              f"{unquantised}; the forward payload alone falls {fwd:.2f}×. Verdict on all bytes (a count, no "
              f"interval), reproduced from {BYTES_REPRODUCED:g}×")
    return (f"MAPL / {variant_label(s['variant'])} bytes per token: forward {fwd:.2f}×, all {total:.2f}×",
            Ruling(REPRODUCED if enough else CONTRADICTED, reason, ("all bytes", "enough" if enough else "short")))


def scale_row(claim: Claim, side: PaperSide, measured: tuple, level: float = 0.95) -> tuple[str, Ruling]:
    """The scale ladder's primary analysis read as an order (positive: the claim): the gap's ln(parameters)
    coefficient with training length held. Where the cells run cannot separate size from length: inconclusive."""
    slope, (widths, span) = measured
    if slope is None:
        return (f"SSN − MAPL by width (width.md): {widths or DASH}",
                Ruling(NOT_TESTABLE, f"the scale ladder has fewer than two rungs with paired runs; the width axis ({span} "
                       "parameters, one seed at 300 steps) gives no interval", ("too few rungs",)))
    size, (lo, hi) = slope["size"], slope["params"]
    alone = (f"slope on size alone {slope['mean']:+.2f} points {fmt_ci(slope['ci'])} ({_pct(slope['level'])}, seeds "
             f"pooled, n = {slope['n']}, {slope['rungs']} rungs, {lo / 1e6:.2f}M-{hi / 1e6:.2f}M non-embedding "
             "parameters)")
    if not size["identified"]:
        corr = f", ln(params) and ln(steps) correlate at r = {size['corr']:.4f}" if size["corr"] is not None else ""
        return (f"ln(params) coefficient, steps held: not identified ({size['cells']} cells{corr}); {alone}",
                Ruling(INCONCLUSIVE, "size and training length move together on the cells run: the primary analysis "
                       f"(the size coefficient with steps held) is not identified ({size['why']}); the slope on size "
                       "alone cannot separate them", ("confounded",)))
    verdict, reason, grounds = order_verdict({"mean": size["size"], "ci": size["ci"], "n": size["n"],
                                              "level": size["level"]})
    return (f"ln(params) coefficient, steps held: {size['size']:+.2f} points {fmt_ci(size['ci'])} "
            f"({_pct(size['level'])}, {size['cells']} cells, {size['df']} df); {alone}",
            Ruling(verdict, reason.replace("the paired", "the size coefficient's") + "; a statement about our "
                   "cells, not the paper's sizes", grounds))


RULES: dict[str, Callable] = {"range": range_row, "order": order_row, "bytes": bytes_row, "scale": scale_row}


# ---- what a claim reads ------------------------------------------------------------------------------------------
@dataclass
class Evidence:
    """The report's rows, those with the other corpus, the frozen-trunk runs; the headline computed once."""
    rows: Sequence[dict]
    corpus_rows: Sequence[dict] | None = None
    frozen_rows: Sequence[dict] | None = None

    @cached_property
    def headline(self) -> list[dict]:
        return headline_summaries(self.rows)

    @cached_property
    def tested(self) -> list[dict]:
        return tested_comparisons(comparisons(self.headline))

    def rows_of(self, study: str) -> Sequence[dict]:
        """A study's rows: with the other corpus's groups where the study is on another corpus."""
        other = study_role(study) == "other-corpus" and self.corpus_rows is not None
        return self.corpus_rows if other else self.rows


Reader = Callable[[Evidence], object]


def headline(*variants: str) -> Reader:
    """The headline's summary of the first of ``variants`` it has."""
    return lambda ev: next((s for v in variants for s in ev.headline if s["variant"] == v), None)


def headline_contrast(a: str, b: str) -> Reader:
    """The headline's tested comparison ``a`` − ``b``."""
    return lambda ev: next((c for c in ev.tested if (c["a"]["variant"], c["b"]["variant"]) == (a, b)), None)


def study_contrast(study: str) -> Reader:
    return lambda ev: study_comparison(ev.rows_of(study), study)


def study_configuration(study: str, name: str) -> Reader:
    return lambda ev: study_configurations(ev.rows_of(study), study).get(name)


def frozen_contrast(projector: str) -> Reader:
    """``projector`` − SPEL on the frozen trunk."""
    return lambda ev: frozen_comparison(ev.frozen_rows or [], projector)


def ablation_contrast(field: str, value: str) -> Reader:
    """MAPL with ``field`` = ``value`` − MAPL, paired by seed, where the ablation has the most seeds (tie: longer)."""
    def read(ev: Evidence) -> dict | None:
        other = next(k for k in MAPL_DEFAULTS if k != field)
        ablated = [r for r in ev.rows if r["method"] == "mapl" and r[field] == value
                   and r[other] == MAPL_DEFAULTS[other]]
        if not ablated:
            return None
        seeds: dict[tuple, set] = {}
        for r in ablated:
            seeds.setdefault(setting_of(r), set()).add(r["seed"])
        key = max(seeds, key=lambda k: (len(seeds[k]), k[3]))
        pool = [r for r in ablated if setting_of(r) == key]
        pool += [r for r in ev.rows if r["variant"] == "mapl" and setting_of(r) == key]
        sums = {s["variant"]: s for s in summarize(pool, ev.rows)}
        b = sums.pop("mapl", None)
        a = next(iter(sums.values()), None)
        p = paired(a["deltas"], b["deltas"]) if a and b else None
        return {"a": a, "b": b, **p} if p else None
    return read


def ladder_slope(ev: Evidence) -> tuple:
    """The scale ladder's slope (on the rows with the code corpus) and, for a cell without one, the width axis's gaps."""
    points = width_points(ev.rows)
    widths = ", ".join(f"d = {p['d']}: {p['gap']['mean']:+.2f} points" for p in points if p.get("gap"))
    model = main_model(ev.rows) or ""
    counts = [r["n_params"] for r in ev.rows if r.get("n_params") and (r["model"].startswith(model) or r["group"] == "width")]
    span = f"{min(counts) / 1e6:.2f}-{max(counts) / 1e6:.2f}M" if counts else "a few million"
    return ladder_slope_comparison(ev.corpus_rows if ev.corpus_rows is not None else ev.rows), (widths, span)


# ---- the paper's side of a claim ---------------------------------------------------------------------------------
def abstract_bound(method: str, template: str = "≤ {:g} % (abstract)") -> Callable[[], PaperSide]:
    """The abstract's largest Δ% of ``method``: a range open below."""
    def side() -> PaperSide:
        bound = paper.paper_value("abstract", "delta_pct_max", method=method)
        return PaperSide(template.format(bound["value"]), None, bound["value"]) if bound else PaperSide(DASH)
    return side


def table1_span(method: str) -> Callable[[], PaperSide]:
    """The span of ``method``'s Δ% over Table 1: a closed range."""
    def side() -> PaperSide:
        values = [e["value"] for e in paper.paper_rows("table1", method=method, quantity="delta_pct")]
        if not values:
            return PaperSide(DASH)
        return PaperSide(f"{min(values):+.2f} to {max(values):+.2f} % (Table 1)", min(values), max(values))
    return side


def abstract_gap(method: str, template: str = "by over {:g} % (abstract)") -> Callable[[], PaperSide]:
    """The abstract's smallest lead over ``method`` ("by over 5 %"): the size an order is tested against."""
    def side() -> PaperSide:
        gap = paper.paper_value("abstract", "gap_min", method=method)
        return PaperSide(template.format(gap["value"]), size=gap["value"]) if gap else PaperSide(DASH)
    return side


def ablation_pair(table: str, a: str, b: str, name_a: str, name_b: str, source: str) -> Callable[[], PaperSide]:
    """Two variants' Δ% of one paper ablation; the lead claimed is their difference."""
    def side() -> PaperSide:
        pa = paper.paper_value(table, "delta_pct", variant=a)
        pb = paper.paper_value(table, "delta_pct", variant=b)
        if not (pa and pb):
            return PaperSide(DASH)
        return PaperSide(f"{name_a} {fmt_pct(pa['value'])} vs {name_b} {fmt_pct(pb['value'])} "
                         f"({source}, {pa['scale']}, {pa['projection_ratio']:g}×)", size=round(pa["value"] - pb["value"], 6))
    return side


def stated(text: str) -> Callable[[], PaperSide]:
    """A paper side that is no number of the paper's."""
    return lambda: PaperSide(text)


# ---- the claims --------------------------------------------------------------------------------------------------
class Claim(NamedTuple):
    """A ledger row: ``label_measured``: the cell names the measured variant; ``family`` empty: a family of its own."""
    claim: str
    paper: Callable[[], PaperSide]
    reads: Reader
    rule: str
    table: str
    label: str = ""
    label_measured: bool = False
    family: str = ""

    @property
    def family_name(self) -> str:
        return self.family or self.claim


_LEARNED_FIXED = ablation_pair("projector_ablation", "fixed", "spel", "fixed", "learned", "App. C")
_STIEFEL_PAIR = ablation_pair("projector_ablation", "unconstrained", "spel", "unconstrained", "SPEL", "App. C")
_IMPLIED_SUBSPACES = stated("implied: learned per-boundary subspaces and anchors together (§1.3, App. C, App. G)")
_RVQ = headline("mapl-rvq-scaled", "mapl-rvq")
# the bytes claim reads MAPL+VQ with its backward message in int8 where it was trained (compressor.grad_wire): with
# the gradient at bf16 the backward alone holds all bytes above half of MAPL's, whatever the forward codes do
_RVQ_BYTES = headline("mapl-rvq-scaled-grad-int8", "mapl-rvq-scaled", "mapl-rvq")
_MAPL_AHEAD_OF_SSN = "MAPL ahead of SSN, in the paper's regime"
_SSN_RANGE, _MAPL_RANGE = "SSN loses 8-15 %", "MAPL costs at most ~2 %"
_LEARNED_BEATS_FIXED, _STIEFEL = "a learned subspace beats a fixed one", "the Stiefel constraint helps"
_MORE_THAN_ANCHORS = "MAPL's lead is more than its anchors"

CLAIMS: tuple[Claim, ...] = (
    Claim("MAPL at 4-8× costs at most ~2 % of validation loss", abstract_bound("mapl"), headline("mapl"), "range",
          "headline.md", "MAPL", family=_MAPL_RANGE),
    Claim("SSN loses 8-15 % at the same ratios", table1_span("ssn"), headline("ssn"), "range", "headline.md", "SSN",
          family=_SSN_RANGE),
    # the primary contrast was named before its runs: a family of its own, read at 95 %
    Claim("MAPL is ahead of SSN by over 5 % at equal compression (primary contrast, named in advance)",
          abstract_gap("ssn"),
          headline_contrast("ssn", "mapl"), "order", "headline-paired.md", "SSN − MAPL"),
    Claim("a learned subspace (SPEL) beats a fixed random one, by 0.35 points (at the headline's 8×)", _LEARNED_FIXED,
          headline_contrast("mapl-fixed", "mapl"), "order", "headline-paired.md", "fixed − MAPL",
          family=_LEARNED_BEATS_FIXED),
    Claim("a learned subspace (SPEL) beats a fixed random one, by 0.35 points (at the ablation's 4×)", _LEARNED_FIXED,
          study_contrast("learned_fixed_4x"), "order", "learned-fixed-4x.md", "fixed − MAPL", family=_LEARNED_BEATS_FIXED),
    Claim("the Stiefel constraint helps: a learned projector without it is worse by 1.72 points (under joint "
          "training)", _STIEFEL_PAIR,
          ablation_contrast("projector", "unconstrained"), "order", "ablation-projector.md", "unconstrained − MAPL",
          family=_STIEFEL),
    # the paper's MAPL+VQ runs at twice MAPL's ratio; ours is what its codes measure (the cell's "× on the wire")
    Claim("MAPL+VQ at 16× (twice MAPL's 8× in the paper) costs at most ~3 %",
          abstract_bound("mapl-rvq", "16× at ≤ {:g} % (abstract)"), _RVQ, "range", "headline.md", "MAPL+VQ",
          label_measured=True),
    Claim("RVQ halves the bytes again", stated("2× (MAPL+VQ at twice MAPL's ratio, Table 1)"),
          lambda ev: (_RVQ_BYTES(ev), headline("mapl")(ev)), "bytes", "headline.md"),
    Claim("the anchors matter: no anchor is worse than the factorized one by 1.28 points",
          ablation_pair("anchor_ablation", "none", "factorized", "no anchor", "factorized", "App. G"),
          ablation_contrast("anchor", "none"), "order", "ablation-anchor.md", "no anchor − MAPL"),
    Claim("MAPL's lead over SSN is more than its anchors (SSN given MAPL's anchors still trails)", _IMPLIED_SUBSPACES,
          study_contrast("decompose"), "order", "decompose-paired.md", "SSN + anchors − MAPL", family=_MORE_THAN_ANCHORS),
    # the capacity explanation: SSN with MAPL's anchors and widened to MAPL's parameter count
    Claim("MAPL's lead over SSN is more than its parameters (SSN with its anchors, widened to MAPL's count, still "
          "trails)", _IMPLIED_SUBSPACES, study_contrast("decompose_capacity"), "order", "decompose-paired.md",
          "SSN + anchors, parameter-matched − MAPL", family=_MORE_THAN_ANCHORS),
    Claim("MAPL is ahead of SSN by over 5 % on a corpus seen at most once (the paper's regime)",
          abstract_gap("ssn", "by over {:g} % (abstract), on DCLM at 20 tokens per parameter: under one pass (Table 1)"),
          study_contrast("corpus"), "order", "corpus.md", "SSN − MAPL", family=_MAPL_AHEAD_OF_SSN),
    # the two range claims again in the paper's regime (a corpus seen under once): the headline's are on a corpus
    # seen 3.6 times, where the uncompressed reference overfits
    Claim("SSN loses 8-15 % (on a corpus seen at most once)", table1_span("ssn"), study_configuration("corpus", "ssn"),
          "range", "corpus.md", "SSN", family=_SSN_RANGE),
    Claim("MAPL costs at most ~2 % (on a corpus seen at most once)", abstract_bound("mapl"),
          study_configuration("corpus", "mapl"), "range", "corpus.md", "MAPL", family=_MAPL_RANGE),
    Claim("MAPL is ahead of SSN by over 5 % with several blocks per stage (the paper's models)",
          abstract_gap("ssn", "by over {:g} % (abstract), at P = 4 and 8 on 150M-1B models (Table 1)"),
          study_contrast("blocks"), "order", "blocks.md", "SSN − MAPL at P = 4", family=_MAPL_AHEAD_OF_SSN),
    # the scale ladder's primary contrast, named before its runs (the size coefficient with training length held):
    # a family of its own, read at 95 %
    Claim("the SSN − MAPL gap grows with model size (the paper: 150M to 1B; ours: an analogue at 0.4-2.5M "
          "parameters, training length held)", stated("Table 1 (150M, 500M, 1B)"), ladder_slope, "scale",
          "size-length.md"),
)

# Mechanism studies: why MAPL's lead exists, not claims of the paper's; the same rules, their own families, kept out
# of the ledger's tally (mechanisms.md)
_FROZEN = "the frozen trunk"
MECHANISMS: tuple[Claim, ...] = (
    Claim("on a trained, frozen trunk (no co-adaptation: only A_p and the anchors train) a learned subspace (SPEL) "
          "beats a fixed random one", stated("implied by App. C (measured there under joint training)"),
          frozen_contrast("fixed"), "order", "frozen-trunk-paired.md", "fixed − SPEL, frozen trunk", family=_FROZEN),
    Claim("on a trained, frozen trunk the Stiefel constraint helps (a learned projector without it is worse)",
          _STIEFEL_PAIR, frozen_contrast("unconstrained"), "order", "frozen-trunk-paired.md",
          "unconstrained − SPEL, frozen trunk", family=_FROZEN),
)


# ---- the ledger --------------------------------------------------------------------------------------------------
def family_levels(specs: Sequence[Claim], measured: Sequence) -> list[tuple[float, int]]:
    """(level, family size m) of each row (docs/protocol.md); only rows with an interval count in m."""
    out = [(0.95, 1)] * len(specs)
    families: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        has_interval = isinstance(measured[i], dict) and measured[i].get("n", 0) >= MIN_SEEDS
        if spec.rule in ("order", "range") and has_interval:
            families.setdefault(spec.family_name, []).append(i)
    for members in families.values():
        m = len(members)
        if m == 1:
            continue
        if specs[members[0]].rule == "order":
            tested = holm([t_test_p(measured[i]["diffs"]) for i in members])
            out = [(tested[members.index(i)]["level"], m) if i in members else o for i, o in enumerate(out)]
        else:
            out = [(1 - 0.05 / m, m) if i in members else o for i, o in enumerate(out)]
    return out


def at_level(c: dict | None, level: float) -> dict | None:
    """Comparison ``c`` with its interval read at ``level`` (its study table may read it in another family)."""
    if c is None or c.get("n", 0) < 2:
        return c
    return {**c, "level": level, "ci": t_interval(c["diffs"], level)}


def evaluate(spec: Claim, ev: Evidence, measured=None, level: float = 0.95, family_size: int = 1) -> dict | None:
    """The ledger row of one claim; None where its rule has nothing to say without the runs."""
    side = spec.paper()
    measured = spec.reads(ev) if measured is None else measured
    if spec.rule == "order":
        measured = at_level(measured, level)
    row = RULES[spec.rule](spec, side, measured, level)
    if row is None:
        return None
    ours, ruling = row
    return {"claim": spec.claim, "paper": side.text, "ours": ours, **ruling._asdict(), "table": spec.table,
            "family": spec.family_name, "family_size": family_size,
            "level": level if spec.rule in ("order", "range") else None}


def _ledger(specs: Sequence[Claim], rows: Sequence[dict], corpus_rows: Sequence[dict] | None,
            frozen_rows: Sequence[dict] | None) -> list[dict]:
    ev = Evidence(rows, corpus_rows, frozen_rows)
    measured = [spec.reads(ev) for spec in specs]
    levels = family_levels(specs, measured)
    return [row for spec, m, (level, size) in zip(specs, measured, levels)
            if (row := evaluate(spec, ev, m, level, size)) is not None]


def claims(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
           frozen_rows: Sequence[dict] | None = None) -> list[dict]:
    """The ledger's rows (the paper's claims), each at its family's level."""
    return _ledger(CLAIMS, rows, corpus_rows, frozen_rows)


def mechanisms(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
               frozen_rows: Sequence[dict] | None = None) -> list[dict]:
    """The mechanism studies' rows (:data:`MECHANISMS`), read by the ledger's rules in their own families."""
    return _ledger(MECHANISMS, rows, corpus_rows, frozen_rows)


def tally(ledger: Sequence[dict]) -> str:
    """"N claims: a reproduced, b contradicted, c inconclusive, d not testable here"."""
    counts = {v: sum(c["verdict"] == v for c in ledger) for v in VERDICTS}
    return (f"{len(ledger)} claims: {counts[REPRODUCED]} reproduced, {counts[CONTRADICTED]} contradicted, "
            f"{counts[INCONCLUSIVE]} inconclusive, {counts[NOT_TESTABLE]} not testable here")


def _family_cell(c: dict) -> str:
    if c["level"] is None:
        return DASH
    if c["family_size"] == 1:
        return f"its own · {_pct(c['level'])}"
    return f"{c['family']} ({c['family_size']} rows) · {_pct(c['level'])}"


_RULE_TEXT = ("Verdict rule (mapl/report/claims.py): reproduced when our interval lies inside a claimed range, or "
              "excludes 0 on the claimed side of an order without lying below the lead the paper claims; "
              "contradicted when it lies wholly outside the range, on the other side of 0, or wholly below the "
              "claimed lead; inconclusive otherwise; fewer than 3 seeds, or a scale we cannot train, is not testable "
              "here. Interval levels: the rows that test one paper claim are one family, and a family's verdicts err "
              "with probability at most 5 % together: its intervals are read at Holm's levels (orders) or "
              "Bonferroni's (ranges), so a row's level is 95 % for a family of one and higher in a larger family "
              "(the last column).")


def claims_table(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
                 frozen_rows: Sequence[dict] | None = None, ledger: Sequence[dict] | None = None,
                 heldout: dict[str, dict[str, str]] | None = None) -> Table:
    """The ledger as a table (``claims.md``); ``ledger``: its :func:`claims` where the caller has them; ``heldout``:
    set label -> {claim: its verdict on that set} (:func:`mapl.report.studies.heldout.heldout_verdicts`)."""
    ledger = claims(rows, corpus_rows, frozen_rows) if ledger is None else ledger
    heldout = heldout or {}
    header = ["paper's claim", "paper", "ours (table)", "verdict", *[f"verdict on {name}" for name in heldout],
              "why", "family · level"]
    body = [[c["claim"], c["paper"], f"{c['ours']} ({c['table']})", c["verdict"],
             *[verdicts.get(c["claim"], DASH) for verdicts in heldout.values()], c["reason"], _family_cell(c)]
            for c in ledger]
    takeaway = f"{tally(ledger)}: " + "; ".join(f"{c['claim']}: {c['verdict']}" for c in ledger) + "."
    caption = ("Each claim of the paper beside our measurement at the headline budget (group long) or the "
               "study named in brackets; a verdict holds at the model size, budget and corpus of its row, on the "
               "validation split; the held-out columns give the same rule's verdict on the same checkpoints scored "
               "on text no run read (heldout-claims.md; — where the rescored runs cannot test the row). "
               + _RULE_TEXT + " The mechanism studies (why MAPL leads; not claims of the paper) are in "
               "mechanisms.md, outside this tally.")
    return Table("claims", "Claims ledger: the paper's claims against our measurements", header, body, caption,
                 takeaway)


def mechanisms_table(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
                     frozen_rows: Sequence[dict] | None = None) -> Table:
    """The mechanism studies' rows by the ledger's rules (``mechanisms.md``), outside the ledger's tally."""
    found = mechanisms(rows, corpus_rows, frozen_rows)
    header = ["mechanism", "paper", "ours (table)", "verdict", "why", "family · level"]
    body = [[c["claim"], c["paper"], f"{c['ours']} ({c['table']})", c["verdict"], c["reason"], _family_cell(c)]
            for c in found]
    caption = ("Studies of why MAPL leads, read by the claims ledger's rules (claims.md) but not claims of the "
               "paper, so not counted in its tally. " + _RULE_TEXT)
    takeaway = "; ".join(f"{c['claim']}: {c['verdict']}" for c in found) + "." if found else \
        "no mechanism study has runs (the frozen-trunk study: DVC stage frozen_trunk)."
    return Table("mechanisms", "Mechanisms: why MAPL leads, by the ledger's rules", header, body, caption, takeaway)
