"""metrics.json (the ledger's verdicts and the primary contrasts) and the LaTeX macros (keys: docs/report.md)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Sequence

from ..base.io import atomic_write_text
from .claims import VERDICTS, Evidence, headline_contrast
from .render import fmt_ci
from .rows import at_best_validation, budget_steps, main_model, run_key
from .stats import summarize
from .studies.axes import token_points, width_points
from .studies.headline import comparisons, headline_summaries
from .studies.heldout import SET_LABELS, heldout_contrasts
from .studies.ladder import ladder_slope_comparison
from .studies.main_budget import table1_summaries

__all__ = ["metrics", "write_metrics", "metric_name", "macro_numbers", "macros", "write_macros"]


_VERDICT_KEYS = dict(zip(VERDICTS, ("reproduced", "contradicted", "inconclusive", "not_testable")))


def _contrast(c: dict | None) -> str:
    if c is None:
        return "not run"
    return f"{c['mean']:+.2f} {fmt_ci(c['ci'])}" if c["ci"] else f"{c['mean']:+.2f} (n = {c['n']})"


def metrics(ledger: Sequence[dict], rows: Sequence[dict], corpus_rows: Sequence[dict] | None = None,
            rescores: dict[str, dict] | None = None, redrawn: Sequence[dict] = ()) -> dict:
    """The metrics (keys: docs/report.md) from the ledger's rows, the report's rows and the held-out scores."""
    corpus_rows = rows if corpus_rows is None else corpus_rows
    out: dict = {key: sum(c["verdict"] == v for c in ledger) for v, key in _VERDICT_KEYS.items()}
    out["ssn_minus_mapl"] = _contrast(headline_contrast("ssn", "mapl")(Evidence(rows)))
    out["ladder_slope"] = _contrast(ladder_slope_comparison(corpus_rows))
    held = heldout_contrasts(rows, corpus_rows, rescores or {}, redrawn)
    out.update({name.replace("-", "_"): _contrast(held[name]) for name in SET_LABELS})
    return out


def write_metrics(m: dict, path: str | Path) -> dict:
    """Write the metrics as indented JSON (atomically); returns them."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(m, indent=1) + "\n")
    return m


# ---- the macros: every number of the per-run tables' headline rows ----------------------------------------------
_ROUND = {"val_loss": 6, "val_loss_std": 6}


def metric_name(s: dict, model: str | None = None, stages: int | None = None) -> str:
    """``mapl_8x``; with a suffix for a model other than ``model`` or a P other than ``stages``."""
    name = s["variant"].replace("-", "_")
    if s.get("projection_ratio") is not None:
        name += f"_{s['wire_ratio']:g}x".replace(".", "p")
    if model is not None and s["model"] != model:
        name += "_m" + "".join(ch for ch in s["model"].lower() if ch.isalnum())
    if stages is not None and s["stages"] != stages:
        name += f"_p{s['stages']}"
    return name


def _entry(s: dict) -> dict:
    e = {"val_loss": s["val_loss"], "seeds": s["n"], "steps": s["steps"],
         "fwd_bytes_per_token": s["fwd_bytes_per_token"], "total_bytes_per_token": s["total_bytes_per_token"]}
    if s["val_loss_std"] is not None:
        e["val_loss_std"] = s["val_loss_std"]
    if s["method"] != "none" and s["delta_pct"] is not None:
        e["delta_pct"] = s["delta_pct"]
        if s["delta_std"] is not None:
            e["delta_std"] = s["delta_std"]
    return {k: (round(v, _ROUND.get(k, 4)) if isinstance(v, float) else v) for k, v in e.items() if v is not None}


def _paired(c: dict) -> dict:
    e = {"mean": round(c["mean"], 4), "n": c["n"]}
    if c["std"] is not None:
        e["std"] = round(c["std"], 4)
    if c["ci"] is not None:
        e["ci95_low"], e["ci95_high"] = round(c["ci"][0], 4), round(c["ci"][1], 4)
    return e


def _axis(points: Sequence[dict], name) -> dict:
    return {name(p): {"ssn_minus_mapl": _paired(p["gap"])} for p in points if p["gap"]}


def macro_numbers(rows: Sequence[dict]) -> dict:
    """Every headline number by key (docs/report.md); sections without runs are left out."""
    model = main_model(rows)
    counts = Counter(r["stages"] for r in rows if r["model"] == model)
    stages = min(counts, key=lambda p: (-counts[p], p)) if counts else None
    ablated = {run_key(r, False) for r in rows if r["group"] == "ablations" and r["variant"] != r["method"]}
    out: dict = {"runs": len(rows)}
    sections = {"main": table1_summaries(rows), "ablations": summarize([r for r in rows if run_key(r, False) in ablated], rows),
                "long": headline_summaries(rows, "long")}
    for key, sums in sections.items():
        if sums:
            out[key] = {metric_name(s, model, stages): _entry(s) for s in sums}
    paired = {f"{metric_name(c['a'], model, stages)}_minus_{metric_name(c['b'], model, stages)}": _paired(c)
              for c in comparisons(sections["long"])}
    if paired:
        out["long_paired"] = paired
    groups = {budget_steps(rows, g, model): g for g in ("long", "tokens", "main")}

    def budget_name(point: dict) -> str:
        return groups.get(point["steps"], f"steps{point['steps']}")
    tokens = _axis(token_points(rows), budget_name)
    tokens_best = _axis(token_points(at_best_validation(rows)), budget_name)
    points = width_points(rows)
    width = _axis(points, lambda p: f"d{p['d']}") if len(points) > 1 else {}
    for key, sec in (("token_axis", tokens), ("token_axis_best", tokens_best), ("width", width)):
        if sec:
            out[key] = sec
    return out


_DIGITS = "Zero One Two Three Four Five Six Seven Eight Nine".split()


def _camel(text: str) -> str:
    """LaTeX-safe CamelCase: letters kept, digits spelled (``8x`` -> ``EightX``, ``1.5`` -> ``OnePtFive``)."""
    out, up = [], True
    for ch in str(text):
        if ch.isdigit():
            out.append(_DIGITS[int(ch)])
            up = True
        elif ch == ".":
            out.append("Pt")
            up = True
        elif ch.isalpha() and ch.isascii():
            out.append(ch.upper() if up else ch)
            up = False
        else:
            up = True
    return "".join(out)


def _format(leaf: str, v) -> str:
    if isinstance(v, int):
        return str(v)
    if leaf.startswith("val_loss"):
        return f"{v:.3f}" if leaf == "val_loss" else f"{v:.4f}"
    if leaf == "delta_pct":
        return f"{v:+.2f}\\%"
    if leaf in ("mean", "ci95_low", "ci95_high"):
        return f"{v:+.2f}"
    return f"{v:.2f}" if leaf.endswith("std") else f"{v:g}"


def macros(m: dict, prefix: str = "res") -> dict[str, str]:
    """LaTeX macro name -> text for every number of :func:`macro_numbers`."""
    out = {}

    def walk(d: dict, path: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, path + _camel(k))
            elif isinstance(v, (int, float)):
                out[path + _camel(k)] = _format(k, v)
    walk(m, prefix)
    return out


def write_macros(m: dict, path: str | Path, prefix: str = "res") -> str:
    """Write the ``\\newcommand`` lines of :func:`macros` (atomically); returns the text."""
    text = "% generated by mapl.report.write_macros from metrics.json; do not edit\n"
    text += "".join(f"\\newcommand{{\\{k}}}{{{v}}}\n" for k, v in sorted(macros(m, prefix).items()))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return text
