"""The claims ledger: each of the paper's claims beside what this artifact measured, and a verdict.

One row per claim, each written once in :data:`CLAIMS` as data: the paper's claim, where the paper's side
comes from (``reports/paper-numbers.csv``, :mod:`mapl.report.paper`: no paper number is written here), what
of ours it reads (a configuration or a contrast of the headline runs, group ``long``: the paired, seeded
comparisons of :mod:`mapl.report.studies`; of a study of :mod:`mapl.report.controls`; of the ablations or
the width axis) and the rule that gives its verdict. :func:`evaluate` turns one specification into a row.
The verdict rules are :data:`RULES` (one function each), the same for every row of a kind, so a reader can
check them:

Three outcomes, symmetric in how much data there is (more seeds can move a row either way):

* a claimed *range* of Δ% (MAPL ≤ 2 %, MAPL+VQ ≤ 3 %, SSN's Table 1 span): **reproduced** when our interval
  of Δ% lies inside the range, **contradicted** when it lies wholly outside, **inconclusive** when it straddles
  a bound;
* a claimed *order* (B ahead of A), read from the paired difference A − B: **reproduced** when the interval
  excludes 0 on the claimed side and does not lie below the claimed size (where the paper states one: "by over
  5 %", an ablation's lead), **contradicted** when it lies wholly on the other side of 0 or wholly below the
  claimed size, **inconclusive** otherwise; the sign and the size are tested and reported separately;
* **not testable here** when we have fewer than 3 seeds of the runs, or the claim is about a scale this
  machine cannot train (the reason says which).

Multiplicity: the rows of one paper claim are one family (:attr:`Claim.family`: the learned-vs-fixed claim read
at 8× and at 4× is one claim); an order family's intervals are read at Holm's levels over its rows
(:func:`mapl.report.stats.holm`), a family of one at 95 %, and ``claims.md`` shows each row's family and level.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Protocol, Sequence

from . import paper
from .controls import study_comparison, study_configurations
from .frozen import frozen_comparison
from .ladder import ladder_slope_comparison
from .rows import MAPL_DEFAULTS, main_model, setting_of, study_role
from .stats import holm, paired, summarize, t_interval, t_test_p
from .studies import comparisons, headline_summaries, tested_comparisons, width_points
from .style import variant_label
from .table import DASH, Table, fmt_ci, fmt_int, fmt_pct

__all__ = ["VERDICTS", "REPRODUCED", "CONTRADICTED", "INCONCLUSIVE", "NOT_TESTABLE", "MIN_SEEDS", "BYTES_REPRODUCED",
           "PaperSide", "PaperSource", "Evidence", "Reading", "Claim", "Ruling",
           "CLAIMS", "RULES", "evaluate", "claims", "claims_table"]

VERDICTS = ("reproduced", "contradicted", "inconclusive", "not testable here")
REPRODUCED, CONTRADICTED, INCONCLUSIVE, NOT_TESTABLE = VERDICTS
MIN_SEEDS = 3            # fewer seeds than this: no verdict (an interval on 2 seeds has 1 degree of freedom)
BYTES_REPRODUCED = 1.8   # "RVQ halves the bytes again": reproduced when all bytes fall at least this much


NOT_RUN = "not run: no results of it among the runs"


# ---- the paper's side of a claim ---------------------------------------------------------------------------------
class PaperSide(NamedTuple):
    """The paper's cell of a row; for a claimed range of Δ%, its bounds (None: open on that side); for a claimed
    order, the lead it claims in points of Δ% (``size``, None where the paper states none)."""
    text: str
    low: float | None = None
    high: float | None = None
    size: float | None = None


class PaperSource(Protocol):
    """Where a claim's paper side comes from."""
    def side(self) -> PaperSide: ...


@dataclass(frozen=True)
class AbstractBound:
    """The abstract's largest Δ% of ``method`` (``template`` formats it): a range open below."""
    method: str
    template: str = "≤ {:g} % (abstract)"

    def side(self) -> PaperSide:
        bound = paper.paper_value("abstract", "delta_pct_max", method=self.method)
        return PaperSide(self.template.format(bound["value"]), None, bound["value"]) if bound else PaperSide(DASH)


@dataclass(frozen=True)
class Table1Span:
    """The span of ``method``'s Δ% over Table 1: a closed range."""
    method: str

    def side(self) -> PaperSide:
        values = [e["value"] for e in paper.paper_rows("table1", method=self.method, quantity="delta_pct")]
        if not values:
            return PaperSide(DASH)
        low, high = min(values), max(values)
        return PaperSide(f"{low:+.2f} to {high:+.2f} % (Table 1)", low, high)


@dataclass(frozen=True)
class AbstractGap:
    """The abstract's smallest lead over ``method`` ("by over 5 %", points or relative: at our losses the two
    agree to 1 %), the size an order claim is tested against; ``template`` formats it."""
    method: str
    template: str = "by over {:g} % (abstract)"

    def side(self) -> PaperSide:
        gap = paper.paper_value("abstract", "gap_min", method=self.method)
        return PaperSide(self.template.format(gap["value"]), size=gap["value"]) if gap else PaperSide(DASH)


@dataclass(frozen=True)
class AblationPair:
    """"fixed +1.19% vs learned +0.84% (App. C, 150M, 4×)": two variants' Δ% of one paper ablation."""
    table: str
    a: str
    b: str
    name_a: str
    name_b: str
    source: str

    def side(self) -> PaperSide:
        pa = paper.paper_value(self.table, "delta_pct", variant=self.a)
        pb = paper.paper_value(self.table, "delta_pct", variant=self.b)
        if not (pa and pb):
            return PaperSide(DASH)
        return PaperSide(f"{self.name_a} {fmt_pct(pa['value'])} vs {self.name_b} {fmt_pct(pb['value'])} "
                         f"({self.source}, {pa['scale']}, {pa['projection_ratio']:g}×)",
                         size=round(pa["value"] - pb["value"], 6))


@dataclass(frozen=True)
class Stated:
    """A paper side that is no number of the paper's (what it implies, where it measured)."""
    text: str

    def side(self) -> PaperSide:
        return PaperSide(self.text)


# ---- what of ours a claim reads ----------------------------------------------------------------------------------
@dataclass
class Evidence:
    """What the ledger reads: the report's rows, the rows with the other corpus's groups too, and the frozen-trunk
    study's runs; the headline's summaries and tested comparisons computed once for every row."""
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
        """The rows a study is read from: with the other corpus's groups where the study is on another corpus."""
        other = study_role(study) == "other-corpus" and self.corpus_rows is not None
        return self.corpus_rows if other else self.rows


class Reading(Protocol):
    """What of ours a claim reads, from the evidence (a summary, a comparison, or what its rule needs)."""
    def measure(self, ev: Evidence): ...


@dataclass(frozen=True)
class HeadlineConfiguration:
    """The summary of the first of ``variants`` among the headline's (group long's budget)."""
    variants: tuple[str, ...]

    def measure(self, ev: Evidence) -> dict | None:
        return next((s for v in self.variants for s in ev.headline if s["variant"] == v), None)


@dataclass(frozen=True)
class HeadlineContrast:
    """The headline's tested comparison ``a`` − ``b``."""
    a: str
    b: str

    def measure(self, ev: Evidence) -> dict | None:
        return next((c for c in ev.tested if (c["a"]["variant"], c["b"]["variant"]) == (self.a, self.b)), None)


@dataclass(frozen=True)
class StudyContrast:
    """The comparison a study's ledger row reads (:func:`mapl.report.controls.study_comparison`)."""
    study: str

    def measure(self, ev: Evidence) -> dict | None:
        return study_comparison(ev.rows_of(self.study), self.study)


@dataclass(frozen=True)
class StudyConfiguration:
    """One configuration's summary in a study (:func:`mapl.report.controls.study_configurations`)."""
    study: str
    name: str

    def measure(self, ev: Evidence) -> dict | None:
        return study_configurations(ev.rows_of(self.study), self.study).get(self.name)


@dataclass(frozen=True)
class FrozenTrunkContrast:
    """``projector`` − SPEL on the frozen trunk (:func:`mapl.report.frozen.frozen_comparison`)."""
    projector: str = "fixed"

    def measure(self, ev: Evidence) -> dict | None:
        return frozen_comparison(ev.frozen_rows or [], self.projector)


@dataclass(frozen=True)
class AblationContrast:
    """MAPL with one ingredient ablated (``field`` = ``value``: ``anchor`` none, ``projector`` unconstrained) − MAPL,
    paired by seed, at the setting (model, P, projection ratio, steps) where the ablation has the most seeds (the
    300-step ablations, or their rerun at the headline budget once it has more; a tie goes to the longer run)."""
    field: str
    value: str

    def measure(self, ev: Evidence) -> dict | None:
        rows = ev.rows
        other = next(k for k in MAPL_DEFAULTS if k != self.field)
        ablated = [r for r in rows if r["method"] == "mapl" and r[self.field] == self.value
                   and r[other] == MAPL_DEFAULTS[other]]
        if not ablated:
            return None
        seeds: dict[tuple, set] = {}
        for r in ablated:
            seeds.setdefault(setting_of(r), set()).add(r["seed"])
        key = max(seeds, key=lambda k: (len(seeds[k]), k[3]))
        pool = [r for r in ablated if setting_of(r) == key]
        pool += [r for r in rows if r["variant"] == "mapl" and setting_of(r) == key]
        sums = {s["variant"]: s for s in summarize(pool, rows)}
        b = sums.pop("mapl", None)
        a = next(iter(sums.values()), None)
        p = paired(a["deltas"], b["deltas"]) if a and b else None
        return {"a": a, "b": b, **p} if p else None


@dataclass(frozen=True)
class BytesAgainst:
    """(``compressed``'s summary, ``against``'s summary) among the headline's: the bytes ratio's two sides."""
    compressed: HeadlineConfiguration
    against: HeadlineConfiguration

    def measure(self, ev: Evidence) -> tuple[dict, dict] | None:
        s, m = self.compressed.measure(ev), self.against.measure(ev)
        return (s, m) if s is not None and m is not None else None


@dataclass(frozen=True)
class LadderSlope:
    """The scale ladder's primary contrast (:func:`mapl.report.ladder.ladder_slope_comparison`), read from the rows
    with the other corpus's groups (the ladder trains on code); the width axis's gaps beside it for the cell when
    the ladder has no slope yet."""

    def measure(self, ev: Evidence):
        rows = ev.corpus_rows if ev.corpus_rows is not None else ev.rows
        return ladder_slope_comparison(rows), WidthGaps().measure(ev)


@dataclass(frozen=True)
class WidthGaps:
    """The SSN − MAPL gap at each width of the width axis, and the parameter span of our models."""

    def measure(self, ev: Evidence) -> tuple[str, str]:
        points = width_points(ev.rows)
        widths = ", ".join(f"d = {p['d']}: {p['gap']['mean']:+.2f} points" for p in points if p.get("gap"))
        return widths, _param_span(ev.rows)


# ---- the specifications ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    """One row of the ledger, as data: the paper's ``claim``, its ``paper`` side, what of ours it ``reads``, the
    ``rule`` of its verdict (:data:`RULES`), how the ours cell names what it reads (``label``; with
    ``label_measured``, the measured configuration's own name where there is one), the ``table`` to see and the
    ``family`` of rows that read one paper claim (empty: a family of its own), whose intervals are read at
    multiplicity-adjusted levels (:func:`family_levels`)."""
    claim: str
    paper: PaperSource
    reads: Reading
    rule: str
    table: str
    label: str = ""
    label_measured: bool = False
    family: str = ""

    @property
    def family_name(self) -> str:
        return self.family or self.claim


_LEARNED_FIXED = AblationPair("projector_ablation", "fixed", "spel", "fixed", "learned", "App. C")
_RVQ = HeadlineConfiguration(("mapl-rvq-scaled", "mapl-rvq"))
# the bytes claim reads MAPL+VQ with its backward message in int8 where it was trained (compressor.grad_wire): with
# the gradient at bf16 the backward alone holds all bytes above half of MAPL's, whatever the forward codes do
_RVQ_BYTES = HeadlineConfiguration(("mapl-rvq-scaled-grad-int8", "mapl-rvq-scaled", "mapl-rvq"))

_MAPL_AHEAD_OF_SSN = "MAPL ahead of SSN, in the paper's regime"
_SSN_RANGE, _MAPL_RANGE = "SSN loses 8-15 %", "MAPL costs at most ~2 %"
_LEARNED_BEATS_FIXED, _STIEFEL = "a learned subspace beats a fixed one", "the Stiefel constraint helps"
_MORE_THAN_ANCHORS = "MAPL's lead is more than its anchors"
_IMPLIED_SUBSPACES = Stated("implied: learned per-boundary subspaces and anchors together (§1.3, App. C, App. G)")

CLAIMS: tuple[Claim, ...] = (
    Claim("MAPL at 4-8× costs at most ~2 % of validation loss", AbstractBound("mapl"),
          HeadlineConfiguration(("mapl",)), "range", "headline.md", "MAPL", family=_MAPL_RANGE),
    Claim("SSN loses 8-15 % at the same ratios", Table1Span("ssn"), HeadlineConfiguration(("ssn",)), "range",
          "headline.md", "SSN", family=_SSN_RANGE),
    # the primary contrast was named before its runs: a family of its own, read at 95 %
    Claim("MAPL is ahead of SSN at equal compression (primary contrast, named in advance)", AbstractGap("ssn"),
          HeadlineContrast("ssn", "mapl"), "order", "headline-paired.md", "SSN − MAPL"),
    Claim("a learned subspace (SPEL) beats a fixed random one (at the headline's 8×)", _LEARNED_FIXED,
          HeadlineContrast("mapl-fixed", "mapl"), "order", "headline-paired.md", "fixed − MAPL",
          family=_LEARNED_BEATS_FIXED),
    Claim("a learned subspace (SPEL) beats a fixed random one (at the ablation's 4×)", _LEARNED_FIXED,
          StudyContrast("learned_fixed_4x"), "order", "learned-fixed-4x.md", "fixed − MAPL",
          family=_LEARNED_BEATS_FIXED),
    Claim("a learned subspace (SPEL) beats a fixed random one on a trained, frozen trunk (no co-adaptation: only A_p "
          "and the anchors train)", Stated("implied by App. C (measured there under joint training)"),
          FrozenTrunkContrast("fixed"), "order", "frozen-trunk-paired.md", "fixed − SPEL, frozen trunk",
          family=_LEARNED_BEATS_FIXED),
    Claim("the Stiefel constraint helps (a learned projector without it is worse; under joint training)",
          AblationPair("projector_ablation", "unconstrained", "spel", "unconstrained", "SPEL", "App. C"),
          AblationContrast("projector", "unconstrained"), "order", "ablation-projector.md", "unconstrained − MAPL",
          family=_STIEFEL),
    Claim("the Stiefel constraint helps (a learned projector without it is worse; on a frozen trunk)",
          AblationPair("projector_ablation", "unconstrained", "spel", "unconstrained", "SPEL", "App. C"),
          FrozenTrunkContrast("unconstrained"), "order", "frozen-trunk-paired.md",
          "unconstrained − SPEL, frozen trunk", family=_STIEFEL),
    Claim("MAPL+VQ (twice MAPL's forward compression) costs at most ~3 %",
          AbstractBound("mapl-rvq", "16× at ≤ {:g} % (abstract)"), _RVQ, "range", "headline.md", "MAPL+VQ",
          label_measured=True),
    Claim("RVQ halves the bytes again", Stated("2× (MAPL+VQ at twice MAPL's ratio, Table 1)"),
          BytesAgainst(_RVQ_BYTES, HeadlineConfiguration(("mapl",))), "bytes", "headline.md"),
    Claim("the anchors matter (no anchor is worse than the factorized one)",
          AblationPair("anchor_ablation", "none", "factorized", "no anchor", "factorized", "App. G"),
          AblationContrast("anchor", "none"), "order", "ablation-anchor.md", "no anchor − MAPL"),
    Claim("MAPL's lead over SSN is more than its anchors (SSN given MAPL's anchors still trails)", _IMPLIED_SUBSPACES,
          StudyContrast("decompose"), "order", "decompose-paired.md", "SSN + anchors − MAPL", family=_MORE_THAN_ANCHORS),
    # the capacity explanation: SSN with MAPL's anchors and widened to MAPL's parameter count
    Claim("MAPL's lead over SSN is more than its parameters (SSN with its anchors, widened to MAPL's count, still "
          "trails)", _IMPLIED_SUBSPACES, StudyContrast("decompose_capacity"), "order", "decompose-paired.md",
          "SSN + anchors, parameter-matched − MAPL", family=_MORE_THAN_ANCHORS),
    Claim("MAPL is ahead of SSN on a corpus seen at most once (the paper's regime)",
          AbstractGap("ssn", "by over {:g} % (abstract), on DCLM at 20 tokens per parameter: under one pass "
                             "(Table 1)"),
          StudyContrast("corpus"), "order", "corpus.md", "SSN − MAPL", family=_MAPL_AHEAD_OF_SSN),
    # the two range claims again in the paper's regime (a corpus seen under once): the headline's are on a corpus
    # seen 3.6 times, where the uncompressed reference overfits
    Claim("SSN loses 8-15 % (on a corpus seen at most once)", Table1Span("ssn"), StudyConfiguration("corpus", "ssn"),
          "range", "corpus.md", "SSN", family=_SSN_RANGE),
    Claim("MAPL costs at most ~2 % (on a corpus seen at most once)", AbstractBound("mapl"),
          StudyConfiguration("corpus", "mapl"), "range", "corpus.md", "MAPL", family=_MAPL_RANGE),
    Claim("MAPL is ahead of SSN with several blocks per stage (the paper's models)",
          AbstractGap("ssn", "by over {:g} % (abstract), at P = 4 and 8 on 150M-1B models (Table 1)"),
          StudyContrast("blocks"), "order", "blocks.md", "SSN − MAPL at P = 4", family=_MAPL_AHEAD_OF_SSN),
    # the scale ladder's primary contrast, named before its runs: a family of its own, read at 95 %
    Claim("the SSN − MAPL gap grows with model scale (150M to 1B)", Stated("Table 1 (150M, 500M, 1B)"), LadderSlope(),
          "scale", "ladder.md"),
)


# ---- the rules: a verdict and the ours cell from what a claim reads ---------------------------------------------
def _pct(level: float) -> str:
    return f"{100 * level:.3g}%"


class Ruling(NamedTuple):
    """A rule's outcome: the verdict, the sentence a reader reads as its reason, and that reason as data
    (``grounds``): what another ledger's row is compared by (:mod:`mapl.report.heldout`), since the sentence also
    carries the interval's level, which differs between ledgers whose families differ."""
    verdict: str
    reason: str
    grounds: tuple = ()


def _untestable(n: int, unit: str) -> Ruling:
    if n == 0:
        return Ruling(NOT_TESTABLE, NOT_RUN, ("not run",))
    return Ruling(NOT_TESTABLE, f"fewer than {MIN_SEEDS} {unit}", ("too few seeds",))


def _range_verdict(ci, low: float | None, high: float | None, n: int = MIN_SEEDS, level: float = 0.95) -> Ruling:
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


def _order_verdict(c: dict | None, size: float | None = None) -> Ruling:
    """``c``: a tested comparison A − B (positive: B ahead), the claim being 'B ahead of A' (by at least ``size``
    points of Δ% where the paper states a lead). The sign and the size are tested on the same interval; the
    grounds are ``("sign", claimed | reversed | unresolved)`` and, with a size, ``("size", short | includes |
    above)``."""
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
    return (f"{c['mean']:+.2f} points {fmt_ci(c['ci'])} ({level}n = {c['n']}, "
            f"{fmt_int(c['a']['steps'])} steps)")


def _range_row(spec: Claim, side: PaperSide, s: dict | None, level: float = 0.95) -> dict:
    """A claimed range of Δ%, read from one configuration's summary ``s`` at the family's ``level``."""
    cell, ci = _delta_cell(s, level)
    ruling = _range_verdict(ci, side.low, side.high, s["n"] if s else 0, level)
    label = variant_label(s["variant"]) if spec.label_measured and s else spec.label
    return {"ours": f"{label}: {cell}", **ruling._asdict()}


def _order_row(spec: Claim, side: PaperSide, c: dict | None, level: float = 0.95) -> dict:
    """A claimed order "B ahead of A", read from the comparison A − B (its interval already at the family's level)."""
    return {"ours": f"{spec.label}: {_comparison_cell(c)}", **_order_verdict(c, side.size)._asdict()}


def _bytes_row(spec: Claim, side: PaperSide, pair: tuple[dict, dict] | None, level: float = 0.95) -> dict | None:
    """All bytes per token of MAPL over the compressed variant's; no row without both."""
    if pair is None:
        return None
    s, m = pair
    fwd = m["fwd_bytes_per_token"] / s["fwd_bytes_per_token"]
    total = m["total_bytes_per_token"] / s["total_bytes_per_token"]
    unquantised = ("the token ids are not quantised, the gradient is int8 (MAPL's: bf16)"
                   if s["variant"].endswith("-grad-int8") else "the gradient and the token ids are not quantised")
    enough = total >= BYTES_REPRODUCED
    return {"ours": f"MAPL / {variant_label(s['variant'])} bytes per token: forward {fwd:.2f}×, all {total:.2f}×",
            "verdict": REPRODUCED if enough else CONTRADICTED, "grounds": ("all bytes", "enough" if enough else "short"),
            "reason": (f"all bytes (both directions, token ids, projector and codebook exchange) fall {total:.2f}×: "
                       f"{unquantised}; the forward payload alone falls "
                       f"{fwd:.2f}×. Verdict on all bytes (a count, no interval), reproduced from "
                       f"{BYTES_REPRODUCED:g}×")}


def _scale_row(spec: Claim, side: PaperSide, measured: tuple, level: float = 0.95) -> dict:
    """The gap's growth with model size, read from the scale ladder's slope of the paired gap in ln(parameters)
    (its sign: positive is the claim); without a slope, what the width axis shows and no verdict."""
    slope, (widths, span) = measured
    if slope is None:
        return {"ours": f"SSN − MAPL by width (width.md): {widths or DASH}", "verdict": NOT_TESTABLE,
                "grounds": ("too few rungs",),
                "reason": (f"the scale ladder has fewer than two rungs with paired runs; the width axis ({span} "
                           "parameters, one seed at 300 steps) gives no interval")}
    verdict, reason, grounds = _order_verdict(slope)
    lo, hi = slope["params"]
    return {"ours": (f"slope of SSN − MAPL per ln(params): {slope['mean']:+.2f} points {fmt_ci(slope['ci'])} "
                     f"({_pct(slope['level'])}, n = {slope['n']}, {slope['rungs']} rungs, {lo / 1e6:.2f}M-{hi / 1e6:.2f}M "
                     "non-embedding parameters)"),
            "verdict": verdict, "grounds": grounds,
            "reason": reason.replace("the paired", "the slope's") + "; a statement about our rungs, not the paper's sizes"}


RULES: dict[str, Callable[..., dict | None]] = {
    "range": _range_row, "order": _order_row, "bytes": _bytes_row, "scale": _scale_row}


# ---- multiplicity: one family per paper claim --------------------------------------------------------------------
def _has_interval(measured) -> bool:
    return isinstance(measured, dict) and measured.get("n", 0) >= MIN_SEEDS


def family_levels(specs: Sequence[Claim], measured: Sequence) -> list[tuple[float, int]]:
    """(level, family size m) of each row: an order family's intervals at Holm's levels over its rows' paired t
    tests of 0 (:func:`mapl.report.stats.holm`: step-down levels while it rejects, then the Bonferroni level); a
    range family's at the Bonferroni level 1 − 0.05/m; a family of one at 95 %. Only rows with an interval (at
    least :data:`MIN_SEEDS` seeds) count in m."""
    out = [(0.95, 1)] * len(specs)
    families: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.rule in ("order", "range") and _has_interval(measured[i]):
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


def _at_level(c: dict | None, level: float) -> dict | None:
    """Comparison ``c`` with its interval re-read at ``level`` (its study table may read it in another family)."""
    if c is None or c.get("n", 0) < 2:
        return c
    return {**c, "level": level, "ci": t_interval(c["diffs"], level)}


def evaluate(spec: Claim, ev: Evidence, measured=None, level: float = 0.95, family_size: int = 1) -> dict | None:
    """The ledger row of one specification: ``claim``, ``paper``, ``ours``, ``verdict``, ``reason`` (and its
    ``grounds``, :class:`Ruling`), ``table``, ``family`` (its name and size) and ``level``; None where its rule
    has nothing to say without the runs (the bytes ratio without both configurations). ``measured``: what it
    reads (default: read now); ``level``: the family's level for its interval (:func:`family_levels`)."""
    side = spec.paper.side()
    measured = spec.reads.measure(ev) if measured is None else measured
    if spec.rule == "order":
        measured = _at_level(measured, level)
    row = RULES[spec.rule](spec, side, measured, level)
    if row is None:
        return None
    return {"claim": spec.claim, "paper": side.text, "ours": row["ours"], "verdict": row["verdict"],
            "reason": row["reason"], "grounds": row["grounds"], "table": spec.table, "family": spec.family_name,
            "family_size": family_size,
            "level": level if spec.rule in ("order", "range") else None}


def claims(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
           frozen_rows: Sequence[dict] | None = None) -> list[dict]:
    """The ledger's rows (:func:`evaluate` of each of :data:`CLAIMS`, at its family's level). ``corpus_rows``: the
    rows with the other corpus's groups too (:func:`mapl.report.rows.select` ``other_corpus``), for the corpus
    study's rows; ``frozen_rows``: the frozen-trunk study's runs (:func:`mapl.report.frozen.load_frozen`), for its
    rows (without them: not run)."""
    ev = Evidence(rows, corpus_rows, frozen_rows)
    measured = [spec.reads.measure(ev) for spec in CLAIMS]
    levels = family_levels(CLAIMS, measured)
    return [row for spec, m, (level, size) in zip(CLAIMS, measured, levels)
            if (row := evaluate(spec, ev, m, level, size)) is not None]


def _param_span(rows: Sequence[dict]) -> str:
    model = main_model(rows) or ""          # once: inside the comprehension it would recount the rows for each row
    counts = [r["n_params"] for r in rows if r.get("n_params") and r["model"].startswith(model)]
    counts += [r["n_params"] for r in rows if r.get("n_params") and r["group"] == "width"]
    if not counts:
        return "a few million"
    return f"{min(counts) / 1e6:.2f}-{max(counts) / 1e6:.2f}M"


def _family_cell(c: dict) -> str:
    if c["level"] is None:
        return DASH
    if c["family_size"] == 1:
        return f"its own · {_pct(c['level'])}"
    return f"{c['family']} ({c['family_size']} rows) · {_pct(c['level'])}"


def claims_table(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
                 frozen_rows: Sequence[dict] | None = None, ledger: Sequence[dict] | None = None) -> Table:
    """The ledger as a table (``claims.md``), first in the report and the README (``corpus_rows``,
    ``frozen_rows``: :func:`claims`; ``ledger``: their :func:`claims` where the caller has them already)."""
    ledger = claims(rows, corpus_rows, frozen_rows) if ledger is None else ledger
    header = ["paper's claim", "paper", "ours (table)", "verdict", "why", "family · level"]
    body = [[c["claim"], c["paper"], f"{c['ours']} ({c['table']})", c["verdict"], c["reason"], _family_cell(c)]
            for c in ledger]
    counts = {v: sum(c["verdict"] == v for c in ledger) for v in VERDICTS}
    takeaway = (f"{len(ledger)} claims: {counts[REPRODUCED]} reproduced, {counts[CONTRADICTED]} contradicted, "
                f"{counts[INCONCLUSIVE]} inconclusive, {counts[NOT_TESTABLE]} not testable here: "
                + "; ".join(f"{c['claim']}: {c['verdict']}" for c in ledger) + ".")
    caption = ("Each claim of the paper beside our measurement at the headline budget (group long) or the "
               "study named in brackets; a verdict holds at the model size, budget and corpus of its row. Verdict "
               "rule (mapl/report/claims.py): reproduced when our interval lies "
               "inside a claimed range, or excludes 0 on the claimed side of an order without lying below the "
               "lead the paper claims; contradicted when it lies wholly outside the range, on the other side of "
               "0, or wholly below the claimed lead; inconclusive otherwise; fewer than 3 seeds, or a scale we "
               "cannot train, is not testable here. The rows of one paper claim are one family: its intervals "
               "at Holm's levels (orders) or Bonferroni's (ranges), a family of one at 95%.")
    return Table("claims", "Claims ledger: the paper's claims against our measurements", header, body, caption,
                 takeaway)
