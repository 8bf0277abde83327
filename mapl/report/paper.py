"""The paper's numbers, read from one data file: ``reports/paper-numbers.csv``.

Every comparison with the paper in the report reads this file; no number of the paper is written in
code. One row per number, with the columns

``table``            table1, table2, projector_ablation (Appendix C), anchor_ablation (Appendix G),
                     geometry, ssn_adamw, abstract, protocolnanogpt (the SSN authors' public records)
``scale``            150M / 500M / 1B (the paper's model sizes), or the size of the other model
``stages``           P, the number of pipeline stages (empty: not stated)
``method``           none, ssn, mapl, mapl-rvq (our method names)
``variant``          the ablated setting (projector or anchor kind, ...), else empty
``reported_ratio``   the ratio column of the paper's table (MAPL+VQ: twice the projection ratio)
``projection_ratio`` d / r of projection methods (r = 256 is inferred from d at each scale)
``quantity``         val_loss, delta_pct, downstream_acc, captured_energy, principal_angle, ...
``value``, ``unit``  the number and its unit
``source``           the table, figure or section it comes from
``certainty``        how sure we are, one of :data:`CERTAINTY` (defined below)
``note``             anything needed to read the number

Certainty labels: ``CONFIRMED-primary`` (the paper's abstract or the authors' public code),
``CONFIRMED-secondary`` (a detailed paper note that quotes the tables, consistent across at least two
independent digests of the PDF), ``TERTIARY`` (one digest only), ``INFERRED`` (our arithmetic).
The PDF itself could not be read in full when the file was written: Table 1 is transcribed from
secondary sources whose Δ% agree with the losses to rounding.

    >>> [e["value"] for e in paper_rows("table1", scale="150M", method="mapl", stages=4)]
    [3.156, 0.84]
"""
from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

__all__ = ["PAPER_NUMBERS", "CERTAINTY", "paper_rows", "paper_value", "paper_table1", "paper_match",
           "paper_ablation"]

PAPER_NUMBERS = Path(__file__).resolve().parents[2] / "reports" / "paper-numbers.csv"
CERTAINTY = ("CONFIRMED-primary", "CONFIRMED-secondary", "TERTIARY", "INFERRED")
_NUMERIC = ("stages", "reported_ratio", "projection_ratio", "value")


def _number(text: str) -> float | int | None:
    if text == "":
        return None
    x = float(text)
    return int(x) if x.is_integer() and "." not in text else x


@lru_cache(maxsize=4)
def _load(path: str) -> tuple[dict, ...]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise FileNotFoundError(f"paper numbers file {path} is missing: it ships with the repository "
                                f"(reports/paper-numbers.csv)") from None
    out = []
    for i, r in enumerate(rows, start=2):
        if r["certainty"] not in CERTAINTY:
            raise ValueError(f"{path}:{i}: certainty={r['certainty']!r} is invalid: allowed {list(CERTAINTY)}")
        out.append({**r, **{k: _number(r[k]) for k in _NUMERIC}})
    return tuple(out)


def paper_rows(table: str | None = None, path: str | Path = PAPER_NUMBERS, **eq) -> list[dict]:
    """Rows of the paper-numbers file (copies), optionally of one ``table`` and with ``row[k] == v``
    for every keyword (numbers compare as numbers: ``stages=4``)."""
    return [dict(r) for r in _load(str(path)) if (table is None or r["table"] == table)
            and all(r.get(k) == v for k, v in eq.items())]


def paper_value(table: str, quantity: str, path: str | Path = PAPER_NUMBERS, **eq) -> dict | None:
    """The one row of ``table`` with this ``quantity`` (and keywords), or None when there is none."""
    rows = paper_rows(table, path, quantity=quantity, **eq)
    if len(rows) > 1:
        raise ValueError(f"paper numbers: {len(rows)} rows match table={table!r} quantity={quantity!r} {eq}")
    return rows[0] if rows else None


def paper_table1(method: str | None = None, stages: int | None = None) -> list[dict]:
    """Table 1 as one dict per (scale, method, P): ``scale, method, stages, reported_ratio,
    projection_ratio, val_loss, delta_pct`` (uncompressed: 0.0) and ``certainty``."""
    out: dict[tuple, dict] = {}
    for r in paper_rows("table1"):
        if (method and r["method"] != method) or (stages and r["stages"] != stages):
            continue
        key = (r["scale"], r["method"], r["stages"])
        e = out.setdefault(key, {"scale": r["scale"], "method": r["method"], "stages": r["stages"],
                                 "reported_ratio": r["reported_ratio"], "projection_ratio": r["projection_ratio"],
                                 "delta_pct": 0.0, "certainty": r["certainty"], "source": r["source"]})
        e[r["quantity"]] = r["value"]
    return list(out.values())


def paper_match(method: str, projection_ratio: float | None, stages: int | None, model: str = "") -> dict | None:
    """The Table 1 entry to put beside one of ours: same method and projection ratio d/r
    (uncompressed: any); the same scale if ``model`` is one of the paper's sizes, else the smallest
    scale with that ratio; the same P if the paper has it, else P = 4."""
    cands = [e for e in paper_table1(method) if method == "none" or e["projection_ratio"] == projection_ratio]
    if not cands:
        return None
    scales = [e["scale"] for e in cands]
    scale = model if model in scales else scales[0]
    cands = [e for e in cands if e["scale"] == scale]
    return next((e for p in (stages, 4) for e in cands if e["stages"] == p), cands[0])


def paper_ablation(kind: str) -> list[dict]:
    """Appendix C (``kind="projector"``) or G (``"anchor"``): one dict per variant, in the paper's
    order: ``variant, label, val_loss, delta_pct, scale, stages, projection_ratio, source, certainty``."""
    out: dict[str, dict] = {}
    for r in paper_rows(f"{kind}_ablation"):
        e = out.setdefault(r["variant"], {"variant": r["variant"], "label": r["note"].split(";")[0],
                                          "scale": r["scale"], "stages": r["stages"],
                                          "projection_ratio": r["projection_ratio"], "source": r["source"],
                                          "certainty": r["certainty"]})
        e[r["quantity"]] = r["value"]
    return list(out.values())
