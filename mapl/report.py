"""Results JSON -> tables (markdown, CSV, LaTeX macros), figures and headline metrics.

The logic behind ``notebooks/report.ipynb`` (and the tables of ``train.ipynb`` / ``data.ipynb``)::

    >>> rows = select(load_results(ROOT), profile="cpu")      # one flat row per run
    >>> print(main_table(rows))                                # Table 1 analog, paper beside ours
    >>> pareto_figure(rows, ROOT / "reports/figures/pareto.png")

A *row* is a flat dict built from one results JSON (``row_from_result``): ``run``, ``group`` (its
folder under ``reports/results``), ``profile``, ``model`` (the preset, with any ``model_overrides``
in brackets: ``tiny[d_model=64,ffn_hidden=192]``), ``stages``, ``method``, ``ratio`` (the
effective ratio 2d / forward bytes per token, rounded), ``nominal_ratio`` (d / r of projection
methods, else None), ``projector``, ``anchor``, ``seed``, ``steps``, ``tokens``, ``val_loss``,
``bytes_per_token`` (forward payload per boundary), ``id_bytes_per_token``, ``uncompressed_bytes``,
``eval_offset``, ``config_hash``, the two loss curves and ``ortho_max_err``.

Conventions. Δ% = 100 (L - L_ref) / L_ref, with L_ref the uncompressed (``none``) run of the same
model, budget (steps) and seed, preferring the same number of stages (P); where that seed is
missing, the mean over the uncompressed seeds. The *main budget* of a model is the smallest step
count among its default-configured runs, the *long budget* the largest of the ``long`` group (without
that group: of all runs) when it is larger. Runs
evaluated on another slice of validation tokens (``train.eval_offset != 0``: the tuning protocol)
never enter the tables. The paper's numbers are data here (``PAPER_*``), each with its source's
certainty label from ``shared/paper/MAPL.md``.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

__all__ = [
    "PAPER_TABLE1", "PAPER_PROJECTOR_ABLATION", "PAPER_ANCHOR_ABLATION", "METHOD_LABELS", "HEADLINE", "TRAIN_SOURCES",
    "load_results", "row_from_result", "select", "delta_pct", "run_key", "group_runs", "reference_loss",
    "summarize", "budgets", "main_rows", "headline", "paper_table1", "paper_match",
    "main_table", "ablation_tables", "seed_table", "val_loss_table", "to_markdown", "to_csv", "write_table",
    "png_bytes", "pareto_figure", "loss_curves_figure",
    "load_bench", "time_to_target_rows", "time_to_target_table", "time_to_target_figure",
    "metrics", "write_metrics", "macros", "write_macros",
    "scaling_rows", "scaling_tables", "scaling_figure", "diagnostics_table", "PAPER_GEOMETRY",
    "data_summary_table", "token_byte_lengths", "token_length_histogram", "token_length_figure", "code_fingerprint",
]

METHOD_LABELS = {"none": "Uncompressed", "int8": "int8", "ssn": "SSN", "mapl": "MAPL", "mapl-rvq": "MAPL+VQ"}
METHOD_ORDER = ("none", "int8", "ssn", "mapl", "mapl-rvq")
_DEFAULTS = {"none": (None, "none"), "int8": (None, "none"), "ssn": ("fixed-shared", "static"),
             "mapl": ("spel", "factorized"), "mapl-rvq": ("spel", "factorized")}   # as mapl.config.METHODS
GROUP_ORDER = ("main", "ablations", "seeds", "long")
DASH = "—"

# Files whose content changes the numbers of a training run; dvc.yaml's train deps list the same.
TRAIN_SOURCES = ("mapl/__init__.py", "mapl/config.py", "mapl/data/*.py", "mapl/model.py", "mapl/stages.py",
                 "mapl/optim.py", "mapl/wire.py", "mapl/diagnostics.py", "mapl/train.py", "mapl/sweep.py", "mapl/compress/*.py",
                 "pyproject.toml")

# ---- the paper's numbers (shared/paper/MAPL.md §3) -----------------------------------------------
_T1 = "CONFIRMED-secondary"
# (scale, method, reported ratio, projection ratio d/r, P, loss, Δ%, certainty)
PAPER_TABLE1: tuple[dict, ...] = tuple(
    dict(scale=s, method=m, ratio=r, proj_ratio=pr, stages=p, val_loss=l, delta_pct=dp, certainty=_T1)
    for s, m, r, pr, p, l, dp in [
        ("150M", "none", 1, None, 4, 3.13, 0.0), ("150M", "none", 1, None, 8, 3.13, 0.0),
        ("150M", "ssn", 4, 4, 4, 3.39, 8.37), ("150M", "ssn", 4, 4, 8, 3.40, 8.63),
        ("150M", "mapl", 4, 4, 4, 3.156, 0.84), ("150M", "mapl", 4, 4, 8, 3.165, 1.11),
        ("150M", "mapl-rvq", 8, 4, 4, 3.165, 1.11), ("150M", "mapl-rvq", 8, 4, 8, 3.170, 1.28),
        ("500M", "none", 1, None, 4, 2.84, 0.0), ("500M", "none", 1, None, 8, 2.84, 0.0),
        ("500M", "ssn", 6, 6, 4, 3.09, 8.92), ("500M", "ssn", 6, 6, 8, 3.12, 9.90),
        ("500M", "mapl", 6, 6, 4, 2.79, -1.90), ("500M", "mapl", 6, 6, 8, 2.84, 0.00),
        ("500M", "mapl-rvq", 12, 6, 4, 2.92, 2.75), ("500M", "mapl-rvq", 12, 6, 8, 2.88, 1.49),
        ("1B", "none", 1, None, 4, 2.68, 0.0), ("1B", "none", 1, None, 8, 2.68, 0.0),
        ("1B", "ssn", 8, 8, 4, 3.05, 13.93), ("1B", "ssn", 8, 8, 8, 3.08, 15.05),
        ("1B", "mapl", 8, 8, 4, 2.72, 1.38), ("1B", "mapl", 8, 8, 8, 2.73, 2.02),
        ("1B", "mapl-rvq", 16, 8, 4, 2.76, 3.01), ("1B", "mapl-rvq", 16, 8, 8, 2.74, 2.30),
    ])
# Appendix C (150M, P = 4, 4x) and Appendix G (150M; its MAPL row equals the P = 8 entry of Table 1)
PAPER_PROJECTOR_ABLATION = {
    "fixed": dict(label="fixed random orthogonal", val_loss=3.1673, delta_pct=1.19, certainty=_T1),
    "unconstrained": dict(label="learned, no manifold constraint (Muon)", val_loss=3.2101, delta_pct=2.56,
                          certainty=_T1),
    "spel": dict(label="learned + SPEL (MAPL)", val_loss=3.1564, delta_pct=0.84, certainty=_T1),
}
PAPER_ANCHOR_ABLATION = {
    "none": dict(label="no anchor", val_loss=3.209, delta_pct=2.39, certainty=_T1),
    "static": dict(label="SSN-style static shift", val_loss=3.212, delta_pct=2.48, certainty=_T1),
    "full": dict(label="fully trainable (V x d per stage)", val_loss=3.149, delta_pct=0.47, certainty=_T1),
    "factorized": dict(label="factorized (MAPL)", val_loss=3.165, delta_pct=1.11, certainty=_T1),
}


# ---- loading ---------------------------------------------------------------------------------
def _round_ratio(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")


def row_from_result(res: dict, group: str = "") -> dict:
    """One flat row from a results JSON dict (keys: see the module docstring)."""
    cfg = res.get("config") or {}
    wire = res.get("wire") or {}
    method = res.get("method", "none")
    nominal = res.get("nominal_ratio") if res.get("projector") else None
    over = cfg.get("model_overrides") or {}
    model = res.get("model", "") + ("[" + ",".join(f"{k}={v}" for k, v in sorted(over.items())) + "]" if over else "")
    return {
        "run": res.get("run", ""), "group": group, "profile": cfg.get("profile", ""),
        "model": model, "stages": res.get("stages"), "method": method,
        "ratio": _round_ratio(res.get("ratio", 1.0)), "nominal_ratio": _round_ratio(nominal),
        "projector": res.get("projector"), "anchor": res.get("anchor"),
        "seed": (res.get("provenance") or {}).get("seed", (cfg.get("train") or {}).get("seed", 0)),
        "steps": res.get("steps"), "tokens": res.get("tokens"), "val_loss": res.get("val_loss"),
        "bytes_per_token": wire.get("fwd_bytes_per_token"), "id_bytes_per_token": wire.get("id_bytes_per_token", 0),
        "uncompressed_bytes": wire.get("uncompressed_bytes_per_token"),
        "eval_offset": (cfg.get("train") or {}).get("eval_offset", 0),
        "config_hash": (res.get("provenance") or {}).get("config_hash", ""),
        "val_loss_curve": res.get("val_loss_curve") or [], "train_loss_curve": res.get("train_loss_curve") or [],
        "ortho_max_err": res.get("ortho_max_err"),
        "d_model": int((wire.get("uncompressed_bytes_per_token") or 0) // 2) or None,
        "boundary_diagnostics": res.get("boundary_diagnostics") or [],
    }


def _group_rank(group: str) -> tuple:
    return (GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), group)


def load_results(root: str | Path, results: str = "reports/results", dedupe: bool = True) -> list[dict]:
    """Rows of every ``<root>/<results>/**/*.json`` that is a results dict, sorted. One row per
    :func:`run_key` (with the seed), profile and evaluation slice: where several runs share one (the
    same config in two groups, or an ad-hoc run differing only in, say, a learning rate), the run of
    the first group in the order main, ablations, seeds, long, then the others by name, is kept
    (``dedupe=False``: every run)."""
    base = Path(root) / results
    found = []
    for path in sorted(base.rglob("*.json")) if base.is_dir() else []:
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(res, dict) or "val_loss" not in res or "method" not in res:
            continue
        group = path.parent.relative_to(base).as_posix() if path.parent != base else ""
        found.append(row_from_result(res, group))
    found.sort(key=lambda r: (_group_rank(r["group"]), r["run"]))
    rows, seen = [], set()
    for r in found:
        key = (r["profile"], r["eval_offset"], *run_key(r)) if dedupe else r["run"] + r["group"]
        if key not in seen:
            seen.add(key)
            rows.append(r)
    return sorted(rows, key=_sort_key)


def _sort_key(r: dict) -> tuple:
    m = r["method"]
    return (str(r["model"]), r.get("stages") or 0, METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m,
            r.get("ratio") or 0, str(r.get("projector")), str(r.get("anchor")), r.get("steps") or 0,
            r.get("seed") or 0, r.get("run", ""))


def select(rows: Iterable[dict], profile: str | None = None, eval_offset: int | None = 0, **eq) -> list[dict]:
    """Rows of ``profile`` (None: any) evaluated at ``eval_offset`` (None: any) with ``row[k] == v``
    for every keyword; rows without a val loss are dropped."""
    out = []
    for r in rows:
        if r.get("val_loss") is None or (profile and r["profile"] != profile):
            continue
        if eval_offset is not None and (r.get("eval_offset") or 0) != eval_offset:
            continue
        if all(r.get(k) == v for k, v in eq.items()):
            out.append(r)
    return out


# ---- Δ% and grouping -------------------------------------------------------------------------
def delta_pct(loss: float | None, ref: float | None) -> float | None:
    """Relative degradation in percent: 100 (loss - ref) / ref (None when either is missing)."""
    if loss is None or ref is None or not ref:
        return None
    return 100.0 * (loss - ref) / ref


KEY = ("model", "stages", "method", "ratio", "projector", "anchor", "steps", "seed")


def run_key(r: dict, with_seed: bool = True) -> tuple:
    """Grouping key (model, P, method, ratio, projector, anchor, steps[, seed])."""
    return tuple(r.get(k) for k in (KEY if with_seed else KEY[:-1]))


def group_runs(rows: Iterable[dict], with_seed: bool = False) -> dict[tuple, list[dict]]:
    """Rows by :func:`run_key` (insertion order kept)."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[run_key(r, with_seed)].append(r)
    return dict(out)


def reference_loss(rows: Sequence[dict], r: dict) -> float | None:
    """Uncompressed loss for ``r``: same model, steps, profile and seed, preferring the same P;
    without that seed, the mean over the uncompressed seeds (same preference)."""
    refs = [x for x in rows if x["method"] == "none" and x["model"] == r["model"] and x["steps"] == r["steps"]
            and x["profile"] == r["profile"] and x.get("val_loss") is not None]
    for pool in ([x for x in refs if x["stages"] == r["stages"]], refs):
        same = [x["val_loss"] for x in pool if x["seed"] == r["seed"]]
        if same:
            return same[0]
        if pool:
            return statistics.fmean(x["val_loss"] for x in pool)
    return None


def _spread(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def summarize(rows: Sequence[dict], within: Sequence[dict] | None = None) -> list[dict]:
    """One summary per key without the seed: ``n``, ``seeds``, mean/std/min/max of the val loss and
    of Δ% (each seed against its own reference); ``within``: where to look for references."""
    within = rows if within is None else within
    out = []
    for key, runs in group_runs(rows).items():
        losses = [x["val_loss"] for x in runs]
        deltas = [d for d in (delta_pct(x["val_loss"], reference_loss(within, x)) for x in runs) if d is not None]
        first = runs[0]
        out.append({**{k: first[k] for k in KEY[:-1]}, "nominal_ratio": first["nominal_ratio"],
                    "bytes_per_token": first["bytes_per_token"], "id_bytes_per_token": first["id_bytes_per_token"],
                    "uncompressed_bytes": first["uncompressed_bytes"], "profile": first["profile"],
                    "n": len(runs), "seeds": sorted(x["seed"] for x in runs),
                    "val_loss": statistics.fmean(losses), "val_loss_std": _spread(losses),
                    "val_loss_min": min(losses), "val_loss_max": max(losses),
                    "delta_pct": statistics.fmean(deltas) if deltas else None, "delta_std": _spread(deltas),
                    "runs": [x["run"] for x in runs]})
    return out


def _is_default(r: dict) -> bool:
    d = _DEFAULTS.get(r["method"])
    return d is None or (r["projector"], r["anchor"]) == d


def budgets(rows: Sequence[dict]) -> dict[str, tuple[int, int | None]]:
    """model -> (main budget, long budget or None) in steps, from the default-configured runs: the
    smallest step count, and the largest of the ``long`` group (without one: of all runs)."""
    steps, long = defaultdict(set), defaultdict(set)
    for r in rows:
        if _is_default(r):
            steps[r["model"]].add(r["steps"])
            if r["group"] == "long":
                long[r["model"]].add(r["steps"])
    out = {}
    for m, s in steps.items():
        lng = max(long[m] or s)
        out[m] = (min(s), lng if lng > min(s) else None)
    return out


def main_rows(rows: Sequence[dict], budget: str = "main") -> list[dict]:
    """Summaries of the default-configured runs at each model's main (or long) budget. Models with
    shape overrides (``tiny[d_model=64,...]``, the scaling study) have their own tables."""
    b = budgets(rows)
    pick = [r for r in rows if _is_default(r) and r["model"] in b and "[" not in r["model"]
            and r["steps"] == (b[r["model"]][0] if budget == "main" else b[r["model"]][1])]
    return summarize(pick, rows)


# ---- the paper ---------------------------------------------------------------------------------
def paper_table1(method: str | None = None, stages: int | None = None) -> list[dict]:
    """The paper's Table 1 entries (copies), optionally filtered by method and P."""
    return [dict(e) for e in PAPER_TABLE1 if (method is None or e["method"] == method)
            and (stages is None or e["stages"] == stages)]


def paper_match(s: dict) -> dict | None:
    """The Table 1 entry to put beside summary ``s``: same method and projection ratio (uncompressed:
    any), the same scale if ``s`` is a paper-size run, else the smallest scale; the same P if
    the paper has it, else P = 4."""
    cands = [e for e in PAPER_TABLE1 if e["method"] == s["method"]
             and (s["method"] == "none" or e["proj_ratio"] == s.get("nominal_ratio"))]
    if not cands:
        return None
    scales = [e["scale"] for e in cands]
    scale = s["model"] if s["model"] in scales else scales[0]
    cands = [e for e in cands if e["scale"] == scale]
    for p in (s.get("stages"), 4):
        for e in cands:
            if e["stages"] == p:
                return dict(e)
    return dict(cands[0])


# ---- formatting --------------------------------------------------------------------------------
def _f(x, nd: int = 4) -> str:
    return DASH if x is None else f"{x:.{nd}f}"


def _pct(x, nd: int = 2) -> str:
    return DASH if x is None else f"{x:+.{nd}f}%"


def _pm(mean, std, nd: int = 4, pct: bool = False) -> str:
    if mean is None:
        return DASH
    s = _pct(mean, nd) if pct else _f(mean, nd)
    return s if std is None else f"{s} ± {std:.{nd}f}"


def _ratio(x) -> str:
    return DASH if x is None else f"{x:g}×"


def to_markdown(header: Sequence[str], body: Sequence[Sequence]) -> str:
    """A GitHub markdown table (cells converted with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_csv(header: Sequence[str], body: Sequence[Sequence]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(body)
    return buf.getvalue()


def write_table(table: tuple[list, list], path: str | Path, title: str = "") -> str:
    """Write ``(header, body)`` as ``<path>.md`` (with an optional title line) and ``<path>.csv``;
    returns the markdown."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header, body = table
    md = to_markdown(header, body)
    path.with_suffix(".md").write_text((f"{title}\n\n" if title else "") + md)
    path.with_suffix(".csv").write_text(to_csv(header, body))
    return md


def _label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


# ---- tables ------------------------------------------------------------------------------------
def main_table(rows: Sequence[dict], budget: str = "main", methods: Sequence[str] | None = None
               ) -> tuple[list, list]:
    """Table 1 analog: per (model, P, method, ratio) our mean val loss (± std over seeds) and Δ%,
    with the paper's entry of the same method and projection ratio beside it (``methods``: only
    these; ``budget="long"``: the long budget)."""
    header = ["model", "P", "method", "ratio", "bytes/token", "steps", "seeds", "val loss", "Δ%",
              "paper (scale, P, ratio)", "paper loss", "paper Δ%"]
    body = []
    for s in main_rows(rows, budget):
        if methods is not None and s["method"] not in methods:
            continue
        p = paper_match(s)
        body.append([s["model"], s["stages"], _label(s["method"]), _ratio(s["ratio"]), _f(s["bytes_per_token"], 0),
                     s["steps"], s["n"], _pm(s["val_loss"], s["val_loss_std"]),
                     _pm(s["delta_pct"], s["delta_std"], 2, pct=True) if s["method"] != "none" else DASH,
                     f"{p['scale']}, P={p['stages']}, {p['ratio']}×" if p else DASH,
                     f"{p['val_loss']:g}" if p else DASH,
                     (_pct(p["delta_pct"]) if p["method"] != "none" else DASH) if p else DASH])
    return header, body


def _setting(r: dict) -> tuple:
    return (r["model"], r["stages"], r["ratio"], r["steps"])


def _ablation_summaries(rows: Sequence[dict], field: str) -> list[dict]:
    """Summaries of the MAPL runs varying ``field`` (projector or anchor) with the other at MAPL's
    default, at every setting (model, P, ratio, steps) where some run leaves the default."""
    default = dict(zip(("projector", "anchor"), _DEFAULTS["mapl"]))
    other = "anchor" if field == "projector" else "projector"
    pool = [r for r in rows if r["method"] == "mapl" and r[other] == default[other]]
    varied = {_setting(r) for r in pool if r[field] != default[field]}
    return summarize([r for r in pool if _setting(r) in varied], rows)


_ABLATIONS = (("projector", PAPER_PROJECTOR_ABLATION, "App. C"), ("anchor", PAPER_ANCHOR_ABLATION, "App. G"))


def ablation_tables(rows: Sequence[dict]) -> dict[str, tuple[list, list]]:
    """``{"projector": table, "anchor": table}``: our MAPL ablations (Δ% vs uncompressed at the same
    budget) beside the paper's Appendix C / G rows (150M), one block per setting we ran (none
    run: one block of dashes)."""
    out = {}
    for field, paper, source in _ABLATIONS:
        sums = _ablation_summaries(rows, field)
        header = [field, "model", "P", "ratio", "steps", "seeds", "val loss", "Δ%", "paper loss", "paper Δ%",
                  "paper source"]
        body = []
        for setting in sorted({_setting(s) for s in sums}, key=str) or [None]:
            model, stages, ratio, steps = setting or (DASH,) * 4
            for name, p in paper.items():
                s = next((x for x in sums if _setting(x) == setting and x[field] == name), None)
                ours = ([s["n"], _pm(s["val_loss"], s["val_loss_std"]), _pm(s["delta_pct"], s["delta_std"], 2, pct=True)]
                        if s else [0, DASH, DASH])
                body.append([f"{name}: {p['label']}", model, stages, _ratio(ratio) if setting else DASH, steps,
                             *ours, f"{p['val_loss']:g}", _pct(p["delta_pct"]), f"{source} ({p['certainty']})"])
        out[field] = (header, body)
    return out


def seed_table(rows: Sequence[dict]) -> tuple[list, list]:
    """Every configuration with at least two seeds: mean ± sample std and the range."""
    header = ["model", "P", "method", "ratio", "projector", "anchor", "steps", "seeds", "val loss (mean ± std)",
              "min", "max", "Δ% (mean ± std)"]
    body = [[s["model"], s["stages"], _label(s["method"]), _ratio(s["ratio"]), s["projector"] or DASH, s["anchor"],
             s["steps"], ",".join(str(x) for x in s["seeds"]), _pm(s["val_loss"], s["val_loss_std"]),
             _f(s["val_loss_min"]), _f(s["val_loss_max"]),
             _pm(s["delta_pct"], s["delta_std"], 2, pct=True) if s["method"] != "none" else DASH]
            for s in summarize(rows) if s["n"] >= 2]
    return header, body


HEADLINE = ("none", "ssn", "mapl")


def headline(rows: Sequence[dict], budget: str = "long") -> list[dict]:
    """The trio uncompressed / SSN / MAPL at the long budget (``budget="main"``: the main one)."""
    return [s for s in main_rows(rows, budget) if s["method"] in HEADLINE]


def val_loss_table(rows: Sequence[dict]) -> tuple[list, list]:
    """Per run: method, ratio, projector, anchor, seed, steps, val loss, Δ% (vs the uncompressed run
    among ``rows``, if any)."""
    header = ["run", "method", "ratio", "projector", "anchor", "seed", "steps", "val loss", "Δ%"]
    body = [[r["run"], _label(r["method"]), _ratio(r["ratio"]), r["projector"] or DASH, r["anchor"], r["seed"],
             r["steps"], _f(r["val_loss"]),
             _pct(delta_pct(r["val_loss"], reference_loss(rows, r))) if r["method"] != "none" else DASH]
            for r in sorted(rows, key=_sort_key)]
    return header, body


# ---- figures -----------------------------------------------------------------------------------
def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)                            # Agg, without touching pyplot's global backend
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, metadata={"Software": None})
    return fig


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (for ``IPython.display.Image(data=...)``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()


def _empty(ax, text: str = "no results yet") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def pareto_figure(rows: Sequence[dict], path: str | Path | None = None, budget: str = "main") -> Figure:
    """Val loss and Δ% against forward bytes per token and boundary (log x), one line per method
    (and per model/P when there are several); error bars = std over seeds."""
    fig, (ax_l, ax_d) = _figure(2)
    sums = main_rows(rows, budget)
    lines = defaultdict(list)
    for s in sums:
        lines[(s["model"], s["stages"], s["method"])].append(s)
    several = len({(m, p) for m, p, _ in lines}) > 1
    for (model, stages, method), pts in sorted(lines.items(), key=lambda kv: _sort_key(kv[1][0])):
        pts = sorted(pts, key=lambda s: -(s["bytes_per_token"] or 0))
        x = [s["bytes_per_token"] for s in pts]
        label = _label(method) + (f" ({model}, P={stages})" if several else "")
        for ax, y, e in ((ax_l, "val_loss", "val_loss_std"), (ax_d, "delta_pct", "delta_std")):
            ys = [s[y] for s in pts]
            if all(v is None for v in ys):
                continue
            err = [s[e] or 0.0 for s in pts]
            ax.errorbar(x, [v if v is not None else np.nan for v in ys], yerr=err if any(err) else None,
                        marker="o", capsize=3, label=label)
            if ax is ax_l:
                for s in pts:
                    ax.annotate(_ratio(s["ratio"]), (s["bytes_per_token"], s["val_loss"]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
    for ax, ylabel in ((ax_l, "validation loss"), (ax_d, "Δ% vs uncompressed")):
        ax.set_xlabel("forward bytes / token / boundary (log)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if sums:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
        else:
            _empty(ax)
    if sums:
        ax_d.axhline(0.0, color="0.5", lw=0.8)
        ax_l.legend(fontsize=8)
    fig.suptitle("Loss against communication (token-matched)")
    return _save(fig, path)


def _smooth(y: Sequence[float], k: int) -> np.ndarray:
    y = np.asarray(y, dtype=float)
    if k <= 1 or len(y) < k:
        return y
    return np.convolve(y, np.ones(k) / k, mode="valid")


def loss_curves_figure(rows: Sequence[dict], path: str | Path | None = None, smooth: int = 10) -> Figure:
    """Train loss (moving average over ``smooth`` steps) and val loss against step, one line per run."""
    fig, (ax_t, ax_v) = _figure(2)
    for r in sorted(rows, key=_sort_key):
        if r["train_loss_curve"]:
            steps, loss = zip(*r["train_loss_curve"])
            y = _smooth(loss, smooth)
            ax_t.plot(steps[len(steps) - len(y):], y, lw=1, label=r["run"])
        if r["val_loss_curve"]:
            steps, loss = zip(*r["val_loss_curve"])
            ax_v.plot(steps, loss, marker=".", lw=1, label=r["run"])
    for ax, title in ((ax_t, f"train loss (mean of {smooth} steps)"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if rows:
        ax_v.legend(fontsize=7)
    else:
        _empty(ax_t), _empty(ax_v)
    return _save(fig, path)


# ---- time to target against link bandwidth ------------------------------------------------------
def load_bench(path: str | Path) -> list[dict]:
    """Step measurements from ``reports/bench/pipeline.json`` (missing file: ``[]``).

    Accepted shapes: ``{"methods": [entry, ...]}`` (what ``benchmarks/pipeline.py`` writes),
    ``{"measurements": [...]}`` or a plain list of entries; an entry holds ``method``, ``ratio`` (the
    effective ratio on the wire; optional for ``none``) and either ``timing`` (a
    ``mapl.link.StepMeasurement.to_dict()``) or ``pipeline.timing`` (a ``mapl.pipeline`` results
    dict). Returns ``{"method", "ratio", "measurement"}`` dicts; entries of another shape are skipped."""
    from .link import StepMeasurement
    path = Path(path)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    entries = (data.get("methods") or data.get("measurements") or []) if isinstance(data, dict) else data
    out = []
    for e in entries if isinstance(entries, list) else []:
        try:
            meas = (StepMeasurement.from_results(e) if "pipeline" in e
                    else StepMeasurement(**{k: v for k, v in e["timing"].items()}))
        except (KeyError, TypeError, ValueError):
            continue
        ratio = e.get("ratio", 1.0 if e.get("method") == "none" else None)
        out.append({"method": e.get("method", "none"), "ratio": _round_ratio(ratio), "measurement": meas})
    return out


def time_to_target_rows(rows: Sequence[dict], bench: Sequence[dict], bandwidths_bps: Sequence[float],
                        target_pct: float = 2.0, latency_s: float = 0.0) -> list[dict]:
    """For each measured method: one common target for all methods, the final val loss of the
    longest uncompressed run + ``target_pct`` %; steps to reach it (interpolated on the val curve of
    the longest default-configured run of that method and effective ratio, of the model with the
    most runs) x the simulated step time on a link of each bandwidth. ``steps_to_target`` and
    ``time_s`` are None where the run never reaches the target."""
    from .link import LinkProfile, steps_to_target, step_time
    if not rows:
        return []
    pool = [r for r in rows if _is_default(r) and reference_loss(rows, r) is not None]
    if not pool:
        return []
    counts = defaultdict(int)
    for r in pool:
        counts[r["model"]] += 1
    model = min(counts, key=lambda m: (-counts[m], m))          # the profile's main model: most runs
    pool = [r for r in pool if r["model"] == model]
    dense = [r for r in pool if r["method"] == "none"]
    if not dense:
        return []
    longest = max(dense, key=lambda r: (r["steps"], -(r["seed"] or 0)))
    target = longest["val_loss"] * (1 + target_pct / 100)
    out = []
    for b in bench:
        cands = [r for r in pool if r["method"] == b["method"] and (b["method"] == "none" or r["ratio"] == b["ratio"])]
        if not cands:
            continue
        run = max(cands, key=lambda r: (r["steps"], -(r["seed"] or 0)))
        n = steps_to_target(run["val_loss_curve"], target)
        for bw in bandwidths_bps:
            st = step_time(b["measurement"], LinkProfile(f"{bw:g}", bw, latency_s))
            out.append({"method": run["method"], "ratio": run["ratio"], "run": run["run"], "bandwidth_bps": bw,
                        "target": target, "steps_to_target": n, "step_s": st,
                        "time_s": None if n is None else n * st})
    return out


def time_to_target_table(ttt: Sequence[dict]) -> tuple[list, list]:
    """:func:`time_to_target_rows` as a table (``—``: never reaches the target)."""
    header = ["method", "ratio", "Mbit/s", "steps to target", "step (s)", "time (s)"]
    body = [[_label(t["method"]), _ratio(t["ratio"]), f"{t['bandwidth_bps'] / 1e6:g}", _f(t["steps_to_target"], 0),
             f"{t['step_s']:.4g}", _f(t["time_s"], 1)] for t in ttt]
    return header, body


def time_to_target_figure(ttt: Sequence[dict], path: str | Path | None = None) -> Figure:
    """Time to the target loss against link bandwidth (log-log), one line per method."""
    fig, (ax,) = _figure(1, 5.5)
    lines = defaultdict(list)
    for t in ttt:
        lines[(t["method"], t["ratio"])].append(t)
    for (method, ratio), pts in sorted(lines.items(), key=lambda kv: str(kv[0])):
        pts = [p for p in pts if p["time_s"] is not None]
        if pts:
            ax.plot([p["bandwidth_bps"] / 1e6 for p in pts], [p["time_s"] for p in pts], marker="o",
                    label=f"{_label(method)} {_ratio(ratio)}")
    ax.set_xlabel("link bandwidth (Mbit/s, log)")
    ax.set_ylabel("time to target (s, log)")
    ax.grid(alpha=0.3)
    if any(p["time_s"] is not None for p in ttt):
        ax.set_xscale("log"), ax.set_yscale("log"), ax.legend(fontsize=8)
    else:
        _empty(ax, "no pipeline benchmark")
    return _save(fig, path)


# ---- metrics and LaTeX macros ------------------------------------------------------------------
def _mkey(s: dict) -> str:
    name = s["method"] if s["method"] in ("none",) else f"{s['method']}-{s['ratio']:g}x"
    return f"{s['model']}-P{s['stages']}-{name}"


def _entry(s: dict) -> dict:
    e = {"val_loss": round(s["val_loss"], 6), "bytes_per_token": s["bytes_per_token"], "seeds": s["n"],
         "steps": s["steps"]}
    if s["val_loss_std"] is not None:
        e["val_loss_std"] = round(s["val_loss_std"], 6)
    if s["method"] != "none" and s["delta_pct"] is not None:
        e["delta_pct"] = round(s["delta_pct"], 4)
    return e


def metrics(rows: Sequence[dict]) -> dict:
    """Headline numbers for ``dvc metrics``: every default-configured method at the main budget,
    the trio at the long budget, and the MAPL-vs-SSN gap in Δ% points at each shared ratio. Keys
    are ``<model>-P<stages>-<method>[-<ratio>x]`` (stable, so ``dvc metrics diff`` lines up)."""
    out: dict = {"runs": len(rows)}
    for budget in ("main", "long"):
        sums = main_rows(rows, budget)
        if sums:
            out[budget] = {_mkey(s): _entry(s) for s in sums if budget == "main" or s["method"] in HEADLINE}
        gaps = {}
        for s in sums:
            if s["method"] == "mapl" and s["delta_pct"] is not None:
                ssn = next((x for x in sums if x["method"] == "ssn" and x["ratio"] == s["ratio"]
                            and (x["model"], x["stages"]) == (s["model"], s["stages"])), None)
                if ssn and ssn["delta_pct"] is not None:
                    gaps[_mkey(s).replace("-mapl-", "-")] = round(ssn["delta_pct"] - s["delta_pct"], 4)
        if gaps:
            out[f"{budget}_ssn_minus_mapl_delta_points"] = gaps
    return out


def write_metrics(rows: Sequence[dict], path: str | Path) -> dict:
    m = metrics(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    return m


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


def macros(m: dict, prefix: str = "res") -> dict[str, str]:
    """LaTeX macro name -> text from :func:`metrics` output, e.g. ``\\resMainTinyPFourMaplEightXDelta``
    -> ``+1.23\\%`` (digits spelled out: LaTeX command names are letters only)."""
    out = {}
    for budget in ("main", "long"):
        for key, e in (m.get(budget) or {}).items():
            base = prefix + _camel(budget) + _camel(key)
            out[base + "Loss"] = f"{e['val_loss']:.3f}"
            if "delta_pct" in e:
                out[base + "Delta"] = f"{e['delta_pct']:+.2f}\\%"
        for key, g in (m.get(f"{budget}_ssn_minus_mapl_delta_points") or {}).items():
            out[prefix + _camel(budget) + "Gap" + _camel(key)] = f"{g:.2f}"
    out[prefix + "Runs"] = str(m.get("runs", 0))
    return out


def write_macros(m: dict, path: str | Path, prefix: str = "res") -> str:
    """``\\newcommand`` lines for :func:`macros`; returns the text written."""
    text = "% generated by mapl.report.write_macros from reports/metrics.json; do not edit\n"
    text += "".join(f"\\newcommand{{\\{k}}}{{{v}}}\n" for k, v in sorted(macros(m, prefix).items()))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    return text


# ---- data statistics (data.ipynb) ---------------------------------------------------------------
def data_summary_table(manifest: dict) -> tuple[list, list]:
    """Split sizes, documents, works and unigram entropy from a data manifest."""
    header = ["split", "tokens", "documents", "works", "unigram entropy (nats)"]
    body = []
    for split in ("train", "val"):
        s = manifest["splits"][split]
        works = s.get("works") or []
        body.append([split, f"{s['tokens']:,}", s["documents"], len(works) if works else DASH,
                     _f(s.get("unigram_entropy"))])
    return header, body


def token_byte_lengths(tok) -> np.ndarray:
    """Bytes of UTF-8 text per token id (special tokens: 0). Byte-level vocabularies count one
    byte per symbol; SentencePiece ones count ``▁`` as a space."""
    from .data import _bytes_to_unicode
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    vocab = tok.get_vocab(with_added_tokens=True)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    lengths = np.zeros(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for piece, i in vocab.items():
        if piece in special:
            continue
        if all(c in inverse for c in piece):
            lengths[i] = len(piece)
        elif piece.startswith("<0x") and piece.endswith(">"):
            lengths[i] = 1                                   # SentencePiece byte fallback
        else:
            lengths[i] = len(piece.replace("\u2581", " ").encode())
    return lengths


def token_length_histogram(tokens: np.ndarray, lengths: np.ndarray) -> dict[int, int]:
    """Occurrences in ``tokens`` by token length in bytes: ``{bytes: count}``."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=len(lengths))
    by_len = np.bincount(lengths, weights=counts[:len(lengths)])
    return {int(k): int(v) for k, v in enumerate(by_len) if v}


def token_length_figure(hist: dict[int, int], path: str | Path | None = None) -> Figure:
    """Bar chart of :func:`token_length_histogram` (share of tokens per length)."""
    fig, (ax,) = _figure(1, 5.0, 3.0)
    total = sum(hist.values()) or 1
    ax.bar(list(hist), [100 * v / total for v in hist.values()], color="C0")
    ax.set_xlabel("token length (bytes)")
    ax.set_ylabel("% of tokens")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


# ---- provenance ----------------------------------------------------------------------------------
def code_fingerprint(root: str | Path, patterns: Sequence[str] = TRAIN_SOURCES) -> str:
    """sha256 over the training sources (paths and contents, sorted): equal fingerprints mean the
    code that produced a checkpoint is the code that would resume it."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()}):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# ---- the scaling study: where does the paper's gap come from? ----------------------------------
# The paper's geometry (MAPL.md §3.4): adjacent-stage principal angle ~53 degrees (up to 72 far
# apart); captured energy at r = 128 after 1,500 steps: ~80% learned vs ~36% fixed random.
PAPER_GEOMETRY = dict(angle_adjacent_deg=53.0, angle_far_deg=72.0, energy_learned=0.80, energy_fixed=0.36,
                      certainty=_T1)
_SCALING_KINDS = (("none", "none", None), ("ssn", "ssn", "fixed-shared"), ("mapl", "mapl", "spel"),
                  ("mapl-fixed", "mapl", "fixed"))


def _scaling_kind(r: dict) -> str | None:
    for name, method, proj in _SCALING_KINDS:
        if r["method"] == method and r["projector"] == proj and (method == "none" or r["nominal_ratio"] == 8):
            if method in ("ssn", "mapl") and r["anchor"] != _DEFAULTS[method][1]:
                return None
            return name
    return None


def scaling_rows(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """(d_model, steps) -> val loss of none / ssn / mapl / mapl-fixed at 8x (seed ``seed``), with
    Δ% against none at the same point and the gaps in points: ssn - mapl, fixed - mapl."""
    pts = defaultdict(dict)
    for r in rows:
        k = _scaling_kind(r)
        if k and r["seed"] == seed and r["stages"] == 4:
            pts[(r["d_model"], r["steps"])][k] = r["val_loss"]
    out = []
    for (d, steps), v in sorted(pts.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
        ref = v.get("none")
        row = {"d_model": d, "steps": steps, **{k: v.get(k) for k, _, _ in _SCALING_KINDS}}
        for k in ("ssn", "mapl", "mapl-fixed"):
            row[f"{k}_delta_pct"] = delta_pct(v.get(k), ref)
        sd, md, fd = row["ssn_delta_pct"], row["mapl_delta_pct"], row["mapl-fixed_delta_pct"]
        row["gap_ssn_minus_mapl"] = None if sd is None or md is None else sd - md
        row["gap_fixed_minus_mapl"] = None if fd is None or md is None else fd - md
        out.append(row)
    return out


def scaling_tables(rows: Sequence[dict], main_steps: int | None = None, width: int = 128
                   ) -> dict[str, tuple[list, list]]:
    """Two tables: the gap against width at the main budget, and against tokens at width ``width``."""
    pts = scaling_rows(rows)
    main_steps = main_steps or min((p["steps"] for p in pts), default=None)
    header = ["d", "steps", "none", "SSN Δ%", "MAPL Δ%", "fixed proj. Δ%", "gap SSN−MAPL (pts)", "gap fixed−MAPL (pts)"]

    def line(p):
        return [p["d_model"], p["steps"], _f(p["none"]), _pct(p["ssn_delta_pct"]), _pct(p["mapl_delta_pct"]),
                _pct(p["mapl-fixed_delta_pct"]), _f(p["gap_ssn_minus_mapl"], 2), _f(p["gap_fixed_minus_mapl"], 2)]
    by_width = [line(p) for p in pts if p["steps"] == main_steps and p["none"] is not None]
    by_tokens = [line(p) for p in pts if p["d_model"] == width and p["none"] is not None]
    return {"width": (header, by_width), "tokens": (header, by_tokens)}


def scaling_figure(rows: Sequence[dict], path: str | Path | None = None, width: int = 128) -> Figure:
    pts = [p for p in scaling_rows(rows) if p["none"] is not None]
    fig, axes = _figure(ncols=2, width=9.0)
    main_steps = min((p["steps"] for p in pts), default=None)
    for ax, sel, xkey, xlabel in ((axes[0], [p for p in pts if p["steps"] == main_steps], "d_model", "width d"),
                                  (axes[1], [p for p in pts if p["d_model"] == width], "steps", "optimizer steps")):
        if not sel:
            _empty(ax)
            continue
        for k, label in (("ssn", "SSN 8×"), ("mapl", "MAPL 8×"), ("mapl-fixed", "fixed projector 8×")):
            xs = [p[xkey] for p in sel if p[f"{k}_delta_pct"] is not None]
            ys = [p[f"{k}_delta_pct"] for p in sel if p[f"{k}_delta_pct"] is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Δ% val loss vs uncompressed")
        ax.axhline(0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"gap vs width ({main_steps} steps)")
    axes[1].set_title(f"gap vs training tokens (d = {width})")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    return _save(fig, path)


def diagnostics_table(rows: Sequence[dict], steps: int | None = None) -> tuple[list, list]:
    """Per run with a projector: captured energy, the PCA optimum at the same rank, principal angles
    between adjacent boundaries and to the PCA subspace, orthogonality drift (means over boundaries)."""
    header = ["run", "r", "captured energy", "PCA energy (best rank-r)", "angle adjacent (°)",
              "angle to PCA (°)", "max |AᵀA−I|"]
    body = []
    for r in rows:
        diags = [d for d in r.get("boundary_diagnostics") or [] if "captured_energy" in d]
        if not diags or (steps is not None and r["steps"] != steps) or r["seed"] != 0:
            continue
        mean = lambda xs: sum(xs) / len(xs) if xs else None          # noqa: E731
        adj = [d["angles_to_next_deg"]["mean"] for d in diags if "angles_to_next_deg" in d]
        body.append([r["run"], diags[0]["rank"], _f(mean([d["captured_energy"] for d in diags]), 3),
                     _f(mean([d["pca_energy"] for d in diags]), 3), _f(mean(adj), 1),
                     _f(mean([d["angles_to_pca_deg"]["mean"] for d in diags]), 1),
                     f"{max(d['ortho_err'] for d in diags):.1e}"])
    return header, body
