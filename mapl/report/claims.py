"""The claims ledger: each of the paper's claims beside what this artifact measured, and a verdict.

One row per claim, each written once in :data:`CLAIMS` as data: the paper's claim, where the paper's side
comes from (``reports/paper-numbers.csv``, :mod:`mapl.report.paper`: no paper number is written here), what
of ours it reads (a configuration or a contrast of the headline runs, group ``long``: the paired, seeded
comparisons of :mod:`mapl.report.studies`; of a study of :mod:`mapl.report.controls`; of the ablations or
the width axis) and the rule that gives its verdict. :func:`evaluate` turns one specification into a row.
The verdict rules are :data:`RULES` (one function each), the same for every row of a kind, so a reader can
check them:

* a claimed *range* of Δ% (MAPL ≤ 2 %, MAPL+VQ ≤ 3 %, SSN's Table 1 span): **reproduced** when our
  95% interval of Δ% meets the range, **not reproduced** when it lies wholly outside;
* a claimed *ordering* (A ahead of B): **reproduced** when the paired interval of the difference
  excludes 0 on the claimed side, **not reproduced** otherwise (the reason says whether the interval
  includes 0 or excludes it on the other side);
* **not testable here** when we have fewer than 3 seeds of the runs, or the claim is about a scale
  this machine cannot train (the reason says which).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Protocol, Sequence

from . import paper
from .controls import study_comparison, study_configurations
from .frozen import frozen_comparison
from .rows import main_model, study_role
from .stats import paired, summarize, t_interval
from .studies import comparisons, headline_summaries, tested_comparisons, width_points
from .style import variant_label
from .table import DASH, Table, fmt_ci, fmt_int, fmt_pct

__all__ = ["VERDICTS", "MIN_SEEDS", "BYTES_REPRODUCED", "PaperSide", "PaperSource", "Evidence", "Reading", "Claim",
           "CLAIMS", "RULES", "evaluate", "claims", "claims_table"]

VERDICTS = ("reproduced", "not reproduced", "not testable here")
MIN_SEEDS = 3            # fewer seeds than this: no verdict (an interval on 2 seeds has 1 degree of freedom)
BYTES_REPRODUCED = 1.8   # "RVQ halves the bytes again": reproduced when all bytes fall at least this much


NOT_RUN = "not run: no results of it among the runs"


# ---- the paper's side of a claim ---------------------------------------------------------------------------------
class PaperSide(NamedTuple):
    """The paper's cell of a row and, for a claimed range of Δ%, its bounds (None: open on that side)."""
    text: str
    low: float | None = None
    high: float | None = None


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
    """The abstract's smallest gap to ``method``."""
    method: str

    def side(self) -> PaperSide:
        gap = paper.paper_value("abstract", "gap_min", method=self.method)
        return PaperSide(f"by over {gap['value']:g} % (abstract)" if gap else DASH)


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
                         f"({self.source}, {pa['scale']}, {pa['projection_ratio']:g}×)")


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
    """fixed − SPEL on the frozen trunk (:func:`mapl.report.frozen.frozen_comparison`)."""

    def measure(self, ev: Evidence) -> dict | None:
        return frozen_comparison(ev.frozen_rows or [])


@dataclass(frozen=True)
class AnchorContrast:
    """No anchor − factorized (MAPL) at the ablations' setting, paired by seed."""

    def measure(self, ev: Evidence) -> dict | None:
        rows = ev.rows
        abl = [r for r in rows if r["group"] == "ablations" and r["method"] == "mapl" and r["anchor"] == "none"]
        if not abl:
            return None
        key = (abl[0]["model"], abl[0]["stages"], abl[0]["projection_ratio"], abl[0]["steps"])
        pool = [r for r in rows if r["method"] == "mapl" and r["projector"] == "spel"
                and r["anchor"] in ("none", "factorized")
                and (r["model"], r["stages"], r["projection_ratio"], r["steps"]) == key]
        sums = {s["variant"]: s for s in summarize(pool, rows)}
        a, b = sums.get("mapl-anchor-none"), sums.get("mapl")
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
    ``label_measured``, the measured configuration's own name where there is one) and the ``table`` to see."""
    claim: str
    paper: PaperSource
    reads: Reading
    rule: str
    table: str
    label: str = ""
    label_measured: bool = False


_LEARNED_FIXED = AblationPair("projector_ablation", "fixed", "spel", "fixed", "learned", "App. C")
_RVQ = HeadlineConfiguration(("mapl-rvq-scaled", "mapl-rvq"))

CLAIMS: tuple[Claim, ...] = (
    Claim("MAPL at 4-8× costs at most ~2 % of validation loss", AbstractBound("mapl"),
          HeadlineConfiguration(("mapl",)), "range", "headline.md", "MAPL"),
    Claim("SSN loses 8-15 % at the same ratios", Table1Span("ssn"), HeadlineConfiguration(("ssn",)), "range",
          "headline.md", "SSN"),
    Claim("MAPL is ahead of SSN at equal compression (primary contrast, named in advance)", AbstractGap("ssn"),
          HeadlineContrast("ssn", "mapl"), "order", "headline-paired.md", "SSN − MAPL"),
    Claim("a learned subspace (SPEL) beats a fixed random one (at the headline's 8×)", _LEARNED_FIXED,
          HeadlineContrast("mapl-fixed", "mapl"), "order", "headline-paired.md", "fixed − MAPL"),
    Claim("a learned subspace (SPEL) beats a fixed random one (at the ablation's 4×)", _LEARNED_FIXED,
          StudyContrast("learned_fixed_4x"), "order", "learned-fixed-4x.md", "fixed − MAPL"),
    Claim("a learned subspace (SPEL) beats a fixed random one on a trained, frozen trunk (no co-adaptation: only A_p "
          "and the anchors train)", Stated("implied by App. C (measured there under joint training)"),
          FrozenTrunkContrast(), "order", "frozen-trunk-paired.md", "fixed − SPEL, frozen trunk"),
    Claim("MAPL+VQ (twice MAPL's forward compression) costs at most ~3 %",
          AbstractBound("mapl-rvq", "16× at ≤ {:g} % (abstract)"), _RVQ, "range", "headline.md", "MAPL+VQ",
          label_measured=True),
    Claim("RVQ halves the bytes again", Stated("2× (MAPL+VQ at twice MAPL's ratio, Table 1)"),
          BytesAgainst(_RVQ, HeadlineConfiguration(("mapl",))), "bytes", "headline.md"),
    Claim("the anchors matter (no anchor is worse than the factorized one)",
          AblationPair("anchor_ablation", "none", "factorized", "no anchor", "factorized", "App. G"),
          AnchorContrast(), "order", "ablation-anchor.md", "no anchor − MAPL"),
    Claim("MAPL's lead over SSN is more than its anchors (SSN given MAPL's anchors still trails)",
          Stated("implied: learned per-boundary subspaces and anchors together (§1.3, App. C, App. G)"),
          StudyContrast("decompose"), "order", "decompose-paired.md", "SSN + anchors − MAPL"),
    Claim("MAPL is ahead of SSN on a corpus seen at most once (the paper's regime)",
          Stated("Table 1 (DCLM, 20 tokens per parameter: under one pass)"), StudyContrast("corpus"), "order",
          "corpus.md", "SSN − MAPL"),
    # the two range claims again in the paper's regime (a corpus seen under once): the headline's are on a corpus
    # seen 3.6 times, where the uncompressed reference overfits
    Claim("SSN loses 8-15 % (on a corpus seen at most once)", Table1Span("ssn"), StudyConfiguration("corpus", "ssn"),
          "range", "corpus.md", "SSN"),
    Claim("MAPL costs at most ~2 % (on a corpus seen at most once)", AbstractBound("mapl"),
          StudyConfiguration("corpus", "mapl"), "range", "corpus.md", "MAPL"),
    Claim("MAPL is ahead of SSN with several blocks per stage (the paper's models)",
          Stated("Table 1 (P = 4 and 8 on 150M-1B models)"), StudyContrast("blocks"), "order", "blocks.md",
          "SSN − MAPL at P = 4"),
    Claim("the SSN − MAPL gap grows with model scale (150M to 1B)", Stated("Table 1 (150M, 500M, 1B)"), WidthGaps(),
          "scale", "width.md"),
)


# ---- the rules: a verdict and the ours cell from what a claim reads ---------------------------------------------
def _range_verdict(ci, low: float | None, high: float | None, n: int = MIN_SEEDS) -> tuple[str, str]:
    if ci is None:
        return VERDICTS[2], NOT_RUN if n == 0 else f"fewer than {MIN_SEEDS} seeds"
    above = high is not None and ci[0] > high
    below = low is not None and ci[1] < low
    if above or below:
        return VERDICTS[1], f"our 95% interval lies wholly {'above' if above else 'below'} the claimed range"
    outside = (low is not None and ci[0] < low) or (high is not None and ci[1] > high)
    if outside:   # the rule's verdict, but a reader should see that the interval does not pin the claim down
        return VERDICTS[0], ("our 95% interval meets the claimed range but reaches outside it: consistent with the "
                             "claim, not a confirmation of it")
    return VERDICTS[0], "our 95% interval meets the claimed range"


def _order_verdict(c: dict | None) -> tuple[str, str]:
    """``c``: a tested comparison A − B (positive: B ahead), the claim being 'B ahead of A'."""
    if c is None:
        return VERDICTS[2], NOT_RUN
    if c["n"] < MIN_SEEDS or c["ci"] is None:
        return VERDICTS[2], f"fewer than {MIN_SEEDS} paired seeds"
    low, high = c["ci"]
    level = f"{100 * c['level']:.3g}%"
    if low > 0:
        return VERDICTS[0], f"the paired {level} interval excludes 0 on the claimed side"
    if high < 0:
        return VERDICTS[1], f"the paired {level} interval excludes 0 on the other side: the order is reversed"
    return VERDICTS[1], f"the paired {level} interval includes 0: no difference resolved"


def _delta_cell(s: dict | None) -> tuple[str, object]:
    if s is None or s["delta_pct"] is None:
        return DASH, None
    ci = t_interval(list(s["deltas"].values())) if s["n"] >= MIN_SEEDS else None
    return (f"{fmt_pct(s['delta_pct'])} {fmt_ci(ci)} (n = {s['n']}, {fmt_int(s['steps'])} steps, "
            f"{s['wire_ratio']:g}× on the wire, {s['total_bytes_per_token']:.1f} B/token in all)"), ci


def _comparison_cell(c: dict | None) -> str:
    if c is None:
        return DASH
    # one seed has no interval and no test level (Holm leaves it out): the cell says n and the budget only
    level = f"{100 * c['level']:.3g}%, " if c.get("level") is not None else ""
    return (f"{c['mean']:+.2f} points {fmt_ci(c['ci'])} ({level}n = {c['n']}, "
            f"{fmt_int(c['a']['steps'])} steps)")


def _range_row(spec: Claim, side: PaperSide, s: dict | None) -> dict:
    """A claimed range of Δ%, read from one configuration's summary ``s``."""
    cell, ci = _delta_cell(s)
    verdict, reason = _range_verdict(ci, side.low, side.high, s["n"] if s else 0)
    label = variant_label(s["variant"]) if spec.label_measured and s else spec.label
    return {"ours": f"{label}: {cell}", "verdict": verdict, "reason": reason}


def _order_row(spec: Claim, side: PaperSide, c: dict | None) -> dict:
    """A claimed order "B ahead of A", read from the comparison A − B."""
    verdict, reason = _order_verdict(c)
    return {"ours": f"{spec.label}: {_comparison_cell(c)}", "verdict": verdict, "reason": reason}


def _bytes_row(spec: Claim, side: PaperSide, pair: tuple[dict, dict] | None) -> dict | None:
    """All bytes per token of MAPL over the compressed variant's; no row without both."""
    if pair is None:
        return None
    s, m = pair
    fwd = m["fwd_bytes_per_token"] / s["fwd_bytes_per_token"]
    total = m["total_bytes_per_token"] / s["total_bytes_per_token"]
    return {"ours": f"MAPL / {variant_label(s['variant'])} bytes per token: forward {fwd:.2f}×, all {total:.2f}×",
            "verdict": VERDICTS[0] if total >= BYTES_REPRODUCED else VERDICTS[1],
            "reason": (f"all bytes (both directions, token ids, projector and codebook exchange) fall {total:.2f}×: "
                       f"the gradient and the token ids are not quantised; the forward payload alone falls "
                       f"{fwd:.2f}×. Verdict on all bytes, reproduced from {BYTES_REPRODUCED:g}×")}


def _scale_row(spec: Claim, side: PaperSide, measured: tuple[str, str]) -> dict:
    """A claim about a scale this machine cannot train: what the width axis shows, never a verdict."""
    widths, span = measured
    return {"ours": f"SSN − MAPL by width: {widths or DASH}", "verdict": VERDICTS[2],
            "reason": (f"our models have {span} parameters, 30-1,000× below the paper's smallest; "
                       "the width axis is one seed at 300 steps")}


RULES: dict[str, Callable[[Claim, PaperSide, object], dict | None]] = {
    "range": _range_row, "order": _order_row, "bytes": _bytes_row, "scale": _scale_row}


def evaluate(spec: Claim, ev: Evidence) -> dict | None:
    """The ledger row of one specification: ``claim``, ``paper``, ``ours``, ``verdict``, ``reason``, ``table``;
    None where its rule has nothing to say without the runs (the bytes ratio without both configurations)."""
    side = spec.paper.side()
    row = RULES[spec.rule](spec, side, spec.reads.measure(ev))
    if row is None:
        return None
    return {"claim": spec.claim, "paper": side.text, "ours": row["ours"], "verdict": row["verdict"],
            "reason": row["reason"], "table": spec.table}


def claims(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
           frozen_rows: Sequence[dict] | None = None) -> list[dict]:
    """The ledger's rows (:func:`evaluate` of each of :data:`CLAIMS`). ``corpus_rows``: the rows with the other
    corpus's groups too (:func:`mapl.report.rows.select` ``other_corpus``), for the corpus study's rows;
    ``frozen_rows``: the frozen-trunk study's runs (:func:`mapl.report.frozen.load_frozen`), for its row
    (without them: not run)."""
    ev = Evidence(rows, corpus_rows, frozen_rows)
    return [row for spec in CLAIMS if (row := evaluate(spec, ev)) is not None]


def _param_span(rows: Sequence[dict]) -> str:
    model = main_model(rows) or ""          # once: inside the comprehension it would recount the rows for each row
    counts = [r["n_params"] for r in rows if r.get("n_params") and r["model"].startswith(model)]
    counts += [r["n_params"] for r in rows if r.get("n_params") and r["group"] == "width"]
    if not counts:
        return "a few million"
    return f"{min(counts) / 1e6:.2f}-{max(counts) / 1e6:.2f}M"


def claims_table(rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
                 frozen_rows: Sequence[dict] | None = None) -> Table:
    """The ledger as a table (``claims.md``), first in the report and the README (``corpus_rows``,
    ``frozen_rows``: :func:`claims`)."""
    ledger = claims(rows, corpus_rows, frozen_rows)
    header = ["paper's claim", "paper", "ours (table)", "verdict", "why"]
    body = [[c["claim"], c["paper"], f"{c['ours']} ({c['table']})", c["verdict"], c["reason"]] for c in ledger]
    counts = {v: sum(c["verdict"] == v for c in ledger) for v in VERDICTS}
    takeaway = (f"{counts['reproduced']} of {len(ledger)} claims reproduced, {counts['not reproduced']} not "
                f"reproduced, {counts['not testable here']} not testable here: "
                + "; ".join(f"{c['claim']}: {c['verdict']}" for c in ledger) + ".")
    caption = ("Each claim of the paper beside our measurement at the headline budget (group long) or the "
               "study named in brackets. Verdict rule (mapl/report/claims.py): a claimed range is reproduced "
               "when our 95% interval meets it; a claimed order when the paired interval excludes 0 on the "
               "claimed side (exploratory comparisons at Holm-adjusted levels); fewer than 3 seeds, or a "
               "scale we cannot train, is not testable here.")
    return Table("claims", "Claims ledger: the paper's claims against our measurements", header, body, caption,
                 takeaway)
