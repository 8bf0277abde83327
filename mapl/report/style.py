"""Names, labels and the fixed plot style of every method: one colour and one marker each, never reused.

A figure's legend names a method and its ratio on the wire (``MAPL+VQ 16× (proj. 8×)``), never a
run id; the line style encodes the wire ratio where one panel holds several ratios of a method.

    >>> label("mapl-rvq", 16, 8)
    'MAPL+VQ 16× (proj. 8×)'
"""
from __future__ import annotations

__all__ = ["METHOD_LABELS", "VARIANT_LABELS", "STYLE", "RATIO_LINESTYLE", "variant_label", "label", "style",
           "linestyle", "fmt_ratio"]

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
}
# variant -> (colour, marker): every colour and every marker appears once (tests check it)
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
}
# wire ratio -> line style, for the panels that show several ratios of one method
RATIO_LINESTYLE = ((1.5, "-"), (6.0, "-"), (12.0, "--"), (24.0, ":"), (float("inf"), "-."))


def fmt_ratio(x: float | None) -> str:
    """``8×``, ``1.97×``; ``—`` for None."""
    return "—" if x is None else f"{x:g}×"


def variant_label(variant: str) -> str:
    """Display name of a variant (unknown ones: the id itself)."""
    return VARIANT_LABELS.get(variant, variant)


def label(variant: str, wire_ratio: float | None, projection_ratio: float | None = None) -> str:
    """Legend label: the variant's name and its wire ratio, with the projection ratio d/r where the
    two differ (MAPL+VQ); the uncompressed run has no ratio."""
    name = variant_label(variant)
    if variant == "none" or wire_ratio is None:
        return name
    text = f"{name} {fmt_ratio(wire_ratio)}"
    if projection_ratio is not None and projection_ratio != wire_ratio:
        text += f" (proj. {fmt_ratio(projection_ratio)})"
    return text


def style(variant: str) -> dict:
    """Matplotlib keywords (colour, marker) of a variant; one outside :data:`STYLE` takes its
    method's colour with a hollow marker."""
    if variant in STYLE:
        colour, marker = STYLE[variant]
        return {"color": colour, "marker": marker}
    method = next((m for m in sorted(METHOD_LABELS, key=len, reverse=True) if variant.startswith(m)), "none")
    colour, marker = STYLE[method]
    return {"color": colour, "marker": marker, "markerfacecolor": "none"}


def linestyle(wire_ratio: float | None) -> str:
    """Line style by wire ratio: solid up to 6×, dashed to 12×, dotted to 24×, dash-dot beyond."""
    x = wire_ratio or 1.0
    return next(ls for bound, ls in RATIO_LINESTYLE if x <= bound)
