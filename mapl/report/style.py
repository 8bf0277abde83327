"""The one plot style: display names, one colour and marker per variant (never reused), neutral colours, what a bar shows."""
from __future__ import annotations

import re

from matplotlib.lines import Line2D

__all__ = ["METHOD_LABELS", "VARIANT_LABELS", "STUDY_VARIANT_LABELS", "FIGURE_LABELS", "STUDY_ARM_LABELS",
           "PROJECTOR_LABELS", "PROJECTOR_VARIANTS", "STYLE", "RATIO_LINESTYLE", "NEUTRAL", "SPEEDUP_CMAP", "BARS",
           "variant_label", "label", "figure_label", "style", "colour", "linestyle", "fmt_ratio", "bars_text",
           "bars_handle"]

METHOD_LABELS = {"none": "Uncompressed", "int8": "int8", "ssn": "SSN", "mapl": "MAPL", "mapl-rvq": "MAPL+VQ"}
VARIANT_LABELS = {
    **METHOD_LABELS,
    "mapl-fixed": "MAPL, fixed projector",
    "mapl-unconstrained": "MAPL, unconstrained projector",
    "mapl-anchor-none": "MAPL, no anchor",
    "mapl-anchor-static": "MAPL, static anchor",
    "mapl-anchor-full": "MAPL, full anchor",
    "mapl-rvq-sync-full": "MAPL+VQ, full codebook sync",
    "mapl-rvq-sync-mirrored": "MAPL+VQ, mirrored codebooks",
    "mapl-rvq-scaled": "MAPL+VQ, per-token scale",
    "mapl-grad-int8": "MAPL, int8 backward",
    "mapl-rvq-scaled-grad-int8": "MAPL+VQ, per-token scale, int8 backward",
}
# the variants only the decomposition study trains (mapl.report.studies.controls.DECOMPOSITION), named in figures; the
# tables print their ids, as the committed tables do (naming them there is a change of tables, not of style)
STUDY_VARIANT_LABELS = {"none-anchor-factorized": "Uncompressed + anchors", "ssn-anchor-factorized": "SSN + anchors",
                        "mapl-fixed-shared": "MAPL, one shared fixed subspace"}
FIGURE_LABELS = {**VARIANT_LABELS, **STUDY_VARIANT_LABELS}
# the decomposition study's arm names (mapl.report.studies.controls.DECOMPOSITION) -> display name; the parameter-matched
# arm shares its variant with "ssn+anchors" and is told apart by name only
STUDY_ARM_LABELS = {"none": "Uncompressed", "none+anchors": "Uncompressed + anchors", "ssn": "SSN",
                    "ssn+anchors": "SSN + anchors", "ssn+anchors, matched": "SSN + anchors, parameter-matched",
                    "mapl-fixed-shared": "MAPL, one shared fixed subspace", "mapl": "MAPL"}
# the frozen-trunk study's projectors (mapl.report.studies.frozen) -> display name, and the variant whose colour they take
PROJECTOR_LABELS = {"spel": "SPEL (learned)", "fixed": "fixed random basis", "unconstrained": "unconstrained (learned)"}
PROJECTOR_VARIANTS = {"spel": "mapl", "fixed": "mapl-fixed", "unconstrained": "mapl-unconstrained"}
# variant -> (colour, marker): every colour and every marker appears once (tests check it). Families share a hue
# where they can: MAPL blues, SSN reds, MAPL+VQ greens, uncompressed black and greys.
STYLE = {
    "none": ("#000000", "o"),
    "int8": ("#7f7f7f", "s"),
    "ssn": ("#d62728", "^"),
    "mapl": ("#1f77b4", "D"),
    "mapl-rvq": ("#2ca02c", "v"),
    "mapl-fixed": ("#ff7f0e", "P"),
    "mapl-unconstrained": ("#9467bd", "X"),
    "mapl-anchor-none": ("#8c564b", "*"),
    "mapl-anchor-static": ("#e377c2", "h"),
    "mapl-anchor-full": ("#17becf", "<"),
    "mapl-rvq-sync-full": ("#bcbd22", ">"),
    "mapl-rvq-sync-mirrored": ("#393b79", "p"),
    "mapl-rvq-scaled": ("#006d2c", "d"),
    "mapl-grad-int8": ("#08306b", (4, 1, 0)),           # a four-pointed star (every filled marker is taken)
    "mapl-rvq-scaled-grad-int8": ("#74c476", (6, 1, 0)),  # a six-pointed star
    "none-anchor-factorized": ("#525252", "8"),
    "ssn-anchor-factorized": ("#f4a582", "H"),
    "mapl-fixed-shared": ("#6baed6", "x"),
}
# wire ratio -> line style, for the panels that show several ratios of one method
RATIO_LINESTYLE = ((1.5, "-"), (6.0, "-"), (12.0, "--"), (24.0, ":"), (float("inf"), "-."))
# the colours that belong to no method: guides, notes, backgrounds, and a comparison's two readings
NEUTRAL = {
    "ink": "0.15",          # a mean drawn without a method (a paired gap), a number key
    "reference": "0.6",     # the zero line, the diagonal where two quantities agree
    "guide": "0.3",         # dotted guides: a trunk's loss, no difference
    "note": "0.35",         # the one-line note of an empty panel; annotations
    "fill": "0.5",          # the band of an interval drawn without a method
    "shade": "0.92",        # a panel region set apart (methods that never reach the target)
    "resolved": "0.0",      # an interval that excludes 0
    "unresolved": "0.6",    # an interval that includes 0
    "bar": "0.45",          # a histogram of no method
    "contour": "white",     # the speedup-1 contour on the speedup colour map
}
# speedup of time to target: red where the method is slower, blue where it is faster (diverging about 1)
SPEEDUP_CMAP = "RdBu"
# what an error bar or band shows; the figure says which (legend entry, axis label or title)
BARS = {
    "sd": "±1 sd over seeds",
    "ci95": "95 % t interval of the mean",
    "range": "min–max over seeds",
    "holm": "t interval of the mean at the study's Holm-adjusted level",
}


def fmt_ratio(x: float | None) -> str:
    """``8×``, ``1.97×``; ``—`` for None."""
    return "—" if x is None else f"{x:g}×"


def variant_label(variant: str, figure: bool = False) -> str:
    """Display name of a variant (unknown: the id); ``figure``: the decomposition's variants named too; a set anchor
    rank (``mapl-ar16``) is named after its base variant's label."""
    labels = FIGURE_LABELS if figure else VARIANT_LABELS
    held = re.fullmatch(r"(.+)-ar(\d+)", variant)
    if variant not in labels and held:
        return f"{variant_label(held.group(1), figure)}, anchor rank {held.group(2)}"
    return labels.get(variant, variant)


def label(variant: str, wire_ratio: float | None, projection_ratio: float | None = None, figure: bool = False) -> str:
    """``MAPL+VQ 16× (proj. 8×)``: the name, the wire ratio and the projection ratio where they differ."""
    name = variant_label(variant, figure)
    if variant == "none" or wire_ratio is None:
        return name
    text = f"{name} {fmt_ratio(wire_ratio)}"
    if projection_ratio is not None and projection_ratio != wire_ratio:
        text += f" (proj. {fmt_ratio(projection_ratio)})"
    return text


def figure_label(variant: str, wire_ratio: float | None, projection_ratio: float | None = None) -> str:
    """A figure's legend label: :func:`label` with every variant named, no ratio for an uncompressed arm."""
    return label(variant, None if _method_of(variant) == "none" else wire_ratio, projection_ratio, figure=True)


def _method_of(variant: str) -> str:
    """The method a variant id starts with (the longest match: ``mapl-rvq-…`` is MAPL+VQ's); ``none`` else."""
    return next((m for m in sorted(METHOD_LABELS, key=len, reverse=True) if variant.startswith(m)), "none")


def style(variant: str) -> dict:
    """Matplotlib colour and marker of a variant (outside :data:`STYLE`: its method's, hollow)."""
    if variant in STYLE:
        colour_, marker = STYLE[variant]
        return {"color": colour_, "marker": marker}
    colour_, marker = STYLE[_method_of(variant)]
    return {"color": colour_, "marker": marker, "markerfacecolor": "none"}


def colour(variant: str) -> str:
    """The colour of a variant (its method's for one outside :data:`STYLE`)."""
    return style(variant)["color"]


def linestyle(wire_ratio: float | None) -> str:
    """Line style by wire ratio: solid up to 6×, dashed to 12×, dotted to 24×, dash-dot beyond."""
    x = wire_ratio or 1.0
    return next(ls for bound, ls in RATIO_LINESTYLE if x <= bound)


def bars_text(kind: str, what: str = "bars") -> str:
    """``bars: ±1 sd over seeds``: what an error bar (``what="band"``: a shaded band) of ``kind`` in :data:`BARS` shows."""
    return f"{what}: {BARS[kind]}"


def bars_handle() -> Line2D:
    """A legend handle that looks like an error bar without a method: the entry :func:`bars_text` labels."""
    return Line2D([], [], color=NEUTRAL["ink"], marker="|", markersize=11, markeredgewidth=1.2, ls="none")
