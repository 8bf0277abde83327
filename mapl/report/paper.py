"""The paper's numbers, one row each with its source and certainty, read from reports/paper-numbers.csv."""
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


@lru_cache(maxsize=1)
def _load() -> tuple[dict, ...]:
    with open(PAPER_NUMBERS, newline="") as f:
        return tuple({**r, **{k: _number(r[k]) for k in _NUMERIC}} for r in csv.DictReader(f))


def paper_rows(table: str | None = None, **eq) -> list[dict]:
    """Rows (copies) of ``table`` with ``row[k] == v`` for every keyword (numbers as numbers)."""
    return [dict(r) for r in _load() if (table is None or r["table"] == table)
            and all(r.get(k) == v for k, v in eq.items())]


def paper_value(table: str, quantity: str, **eq) -> dict | None:
    """The one row of ``table`` with this ``quantity`` (and keywords), or None."""
    rows = paper_rows(table, quantity=quantity, **eq)
    if len(rows) > 1:
        raise ValueError(f"paper numbers: {len(rows)} rows match table={table!r} quantity={quantity!r} {eq}")
    return rows[0] if rows else None


def paper_table1(method: str | None = None, stages: int | None = None) -> list[dict]:
    """Table 1, one dict per (scale, method, P) with its ratios, ``val_loss`` and ``delta_pct`` (uncompressed: 0)."""
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
    """The Table 1 entry beside one of ours: same method and projection ratio, at ``model``'s scale (else the
    smallest) and P (else 4)."""
    cands = [e for e in paper_table1(method) if method == "none" or e["projection_ratio"] == projection_ratio]
    if not cands:
        return None
    scales = [e["scale"] for e in cands]
    scale = model if model in scales else scales[0]
    cands = [e for e in cands if e["scale"] == scale]
    return next((e for p in (stages, 4) for e in cands if e["stages"] == p), cands[0])


def paper_ablation(kind: str) -> list[dict]:
    """Appendix C (``kind='projector'``) or G (``'anchor'``): one dict per variant, in the paper's order."""
    out: dict[str, dict] = {}
    for r in paper_rows(f"{kind}_ablation"):
        e = out.setdefault(r["variant"], {"variant": r["variant"], "label": r["note"].split(";")[0],
                                          "scale": r["scale"], "stages": r["stages"],
                                          "projection_ratio": r["projection_ratio"], "source": r["source"],
                                          "certainty": r["certainty"]})
        e[r["quantity"]] = r["value"]
    return list(out.values())
