"""Results JSON -> one flat row per run (fields: docs/report.md); loading, selection, keys and budgets."""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from ..base.declared_groups import APART_ROLES, Declaration, declaration
from ..core.config import METHODS, PROJECT_ROOT, load_params

__all__ = ["declared", "study_role", "study_groups", "METHOD_ORDER", "KEY",
           "ResultsError", "results_dir", "row_from_result", "eval_set", "load_results", "select",
           "total_bytes_per_token", "variant_of", "is_reference", "is_default", "run_key", "group_runs", "sort_key",
           "MAPL_DEFAULTS", "setting_of", "rescored_rows", "redrawn_rows",
           "report_selections", "boundary_mean", "main_model",
 "budget_steps", "at_projection_ratio", "at_best_validation", "train_split_tokens"]

METHOD_ORDER = ("none", "int8", "ssn", "mapl", "mapl-rvq")
KEY = ("model", "stages", "method", "wire_ratio", "projector", "anchor", "anchor_rank", "rvq_sync", "rvq_scale",
       "grad_wire", "data_source", "steps", "seed")


def declared() -> Declaration:
    """The run groups params.yaml declares (each one's study and role), read again only when the file changes."""
    path = PROJECT_ROOT / "params.yaml"
    stat = path.stat()
    return _declared_at(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _declared_at(path: str, mtime_ns: int, size: int) -> Declaration:
    return declaration(load_params(Path(path)))


def study_role(study: str) -> str:
    """How the report reads a study's rows: ``reported``, ``tuning``, ``other-corpus``, ..."""
    return declared().role_of_study(study)


def study_groups(study: str) -> str:
    """A study's DVC groups for captions: "group blocks", "groups long, long_rvq and long_fixed"."""
    groups = declared().groups_of(study) or (study,)
    return f"group {groups[0]}" if len(groups) == 1 else f"groups {', '.join(groups[:-1])} and {groups[-1]}"


def results_dir(profile: str, root: str | Path = "") -> Path:
    """``<root>/reports/<profile>/results``."""
    return Path(root) / "reports" / profile / "results"


def _get(d: dict, *paths: str):
    """The first of the dotted ``paths`` present in the nested dict ``d``."""
    for path in paths:
        cur = d
        for part in path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")


def total_bytes_per_token(res: dict) -> float | None:
    """All bytes on the wire per training token and boundary (the results' own total where they carry one)."""
    total = (res.get("wire") or {}).get("total_bytes_per_token_per_boundary")
    return float(total) if total is not None else _per_token(res)


def _per_token(res: dict, *kinds: str) -> float | None:
    """Declared bytes of ``kinds`` (default: all) per token and boundary; None without a declaration."""
    wire = res.get("wire") or {}
    declared, tokens, stages = wire.get("declared"), res.get("tokens"), res.get("stages")
    if not declared or not tokens or not stages or stages < 2:
        return None
    return sum(v for k, v in declared.items() if not kinds or k in kinds) / (tokens * (stages - 1))


def variant_of(method: str, projector: str | None, anchor: str | None, rvq_sync: str | None = None,
               rvq_scale: str | None = None, grad_wire: str | None = None, anchor_rank: int = 0) -> str:
    """The method plus every setting off the method's default: ``mapl-fixed``, ``mapl-rvq-scaled-grad-int8``,
    ``mapl-ar16`` (a projector's anchors at a rank set apart from r, which they follow by default)."""
    default = METHODS.get(method, {})
    name = method
    if projector is not None and projector != default.get("projector"):
        name += f"-{projector}"
    if anchor is not None and anchor != default.get("anchor"):
        name += f"-anchor-{anchor}"
    if anchor_rank and projector is not None:
        name += f"-ar{anchor_rank}"
    if rvq_sync not in (None, "stream"):
        name += f"-sync-{rvq_sync}"
    if rvq_scale not in (None, "none"):
        name += "-scaled"
    if grad_wire not in (None, "same"):
        name += f"-grad-{grad_wire}"
    return name


def row_from_result(res: dict, group: str = "") -> dict:
    """One flat row from a results JSON dict (fields: docs/report.md)."""
    cfg, wire, prov = res.get("config") or {}, res.get("wire") or {}, res.get("provenance") or {}
    overrides = ",".join(f"{k}={v}" for k, v in sorted((cfg.get("model_overrides") or {}).items()))
    method, projector = res.get("method", "none"), res.get("projector")
    rvq_sync = _get(cfg, "compressor.rvq.sync", "compressor.rvq_sync") if method == "mapl-rvq" else None
    rvq_scale = (_get(cfg, "compressor.rvq.scale") or "none") if method == "mapl-rvq" else None
    grad_wire = _get(cfg, "compressor.grad_wire") or "same"
    uncompressed = wire.get("uncompressed_bytes_per_token")
    return {
        "run": res.get("run", ""), "group": group, "profile": cfg.get("profile", ""),
        "config_hash": prov.get("config_hash", ""),
        "model": res.get("model", "") + (f"[{overrides}]" if overrides else ""), "base_model": res.get("model", ""),
        "d_model": int(uncompressed // 2) if uncompressed else None, "stages": res.get("stages"),
        "method": method, "projector": projector, "anchor": res.get("anchor"), "rvq_sync": rvq_sync,
        "rvq_scale": rvq_scale, "grad_wire": grad_wire,
        "variant": variant_of(method, projector, res.get("anchor"), rvq_sync, rvq_scale, grad_wire,
                              _get(cfg, "compressor.anchor.rank") or 0),
        "wire_ratio": _round(res.get("ratio", 1.0)),
        "projection_ratio": _round(res.get("nominal_ratio")) if projector else None,
        "seed": prov.get("seed", _get(cfg, "train.seed") or 0), "steps": res.get("steps"),
        "tokens": res.get("tokens"), "train_split_tokens": res.get("train_split_tokens"),
        "eval_offset": _get(cfg, "train.eval_offset") or 0, "eval_set": eval_set(cfg),
        "val_loss": res.get("val_loss"),
        "val_loss_curve": res.get("val_loss_curve") or [], "train_loss_curve": res.get("train_loss_curve") or [],
        "data_source": _get(cfg, "data.source") or "", "data_sampling": _get(cfg, "data.sampling") or "uniform",
        "anchor_rank": _get(cfg, "compressor.anchor.rank") or 0,
        "select_loss": res.get("select_loss"), "select_loss_curve": res.get("select_loss_curve") or [],
        "n_params": res.get("n_params"),
        "fwd_bytes_per_token": wire.get("fwd_bytes_per_token"), "bwd_bytes_per_token": wire.get("bwd_bytes_per_token"),
        "id_bytes_per_token": wire.get("id_bytes_per_token", 0), "uncompressed_bytes_per_token": uncompressed,
        "total_bytes_per_token": total_bytes_per_token(res),
        "state_bytes_per_token": _per_token(res, "state"), "sync_bytes_per_token": _per_token(res, "piggyback"),
        "lr_muon": _get(cfg, "train.lr_muon"), "lr_embed": _get(cfg, "train.lr_embed"),
        "lr_head": _get(cfg, "train.lr_head"),
        "proj_lr_mult": _get(cfg, "compressor.projector.lr_mult", "compressor.proj_lr_mult"),
        "ortho_max_err": res.get("ortho_max_err"), "boundary_diagnostics": res.get("boundary_diagnostics") or [],
        "codebook_batch_perplexity": _min_over_boundaries(res.get("diagnostics"), "batch_perplexity_mean"),
        **_health(res.get("boundary_health")),
    }


def eval_set(cfg: dict) -> str:
    """Which validation tokens ``val_loss`` is measured on: ``"whole split"`` or ``"val[a:b)"``."""
    tokens, offset = _get(cfg, "train.eval_tokens"), _get(cfg, "train.eval_offset") or 0
    if tokens is None:
        tokens = 65536                               # the setting's default before it was written out
    if tokens == 0:
        return "whole split" if offset == 0 else f"val[{offset:,}:)"
    return f"val[{offset:,}:{offset + tokens:,})"


def _health(health: dict | None) -> dict:
    """The early warning's record: readings, the largest max |z| (and where), the first warning's step."""
    readings = (health or {}).get("readings") or []
    peak = max(((b.get("train_max"), p) for r in readings for p, b in enumerate(r["boundaries"])
                if b.get("train_max") is not None), default=(None, None))
    warnings = (health or {}).get("warnings") or []
    return {"health_readings": readings, "max_abs_z_peak": peak[0], "max_abs_z_boundary": peak[1],
            "first_warning_step": min((w["step"] for w in warnings), default=None),
            "health_recorded": bool(readings)}


def _min_over_boundaries(diagnostics, key: str) -> float | None:
    values = [d[key] for d in (diagnostics or {}).values() if isinstance(d, dict) and d.get(key) is not None]
    return min(values) if values else None


class ResultsError(ValueError):
    """A results JSON the report cannot use (leaving it out would silently change every table it is in)."""


_FIX = "rerun that run (`dvc repro train@<run>`), or move the file out of the results folder"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# the top-level fields the tables read, with the type each must have where present (a hand-edited or foreign file
# with ``"steps": "many"`` fails here in one line, not deep inside a table with a TypeError)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "run": (str,), "method": (str,), "model": (str,), "projector": (str,), "anchor": (str,), "stages": (int,),
    "steps": (int,), "tokens": (int,), "n_params": (int,), "train_split_tokens": (int,), "ratio": (int, float),
    "nominal_ratio": (int, float), "select_loss": (int, float), "wall_s": (int, float), "train_wall_s": (int, float),
    "tokens_per_s": (int, float), "wire": (dict,), "config": (dict,), "diagnostics": (dict,),
    "boundary_diagnostics": (list,)}
_WANT = {(str,): "a string", (int,): "an integer", (int, float): "a finite number", (dict,): "an object",
         (list,): "a list"}


def _check_fields(path: Path, res: dict) -> None:
    """Each field of :data:`_FIELD_TYPES` the file has is of its type (``null`` allowed: no value)."""
    for key, types in _FIELD_TYPES.items():
        value = res.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ResultsError(f"{path}: {key} is {value!r}, not {_WANT[types]}: the file is damaged; {_FIX}")


def _check_losses(path: Path, res: dict) -> None:
    """val_loss and both loss curves are finite (a diverged run writes no results: anything else is damage)."""
    if not _finite(res.get("val_loss")):
        raise ResultsError(f"{path}: val_loss is {res.get('val_loss')!r}, not a finite number: the file is damaged "
                           f"or was not written by a finished run; {_FIX}")
    for key in ("val_loss_curve", "train_loss_curve"):
        curve = res.get(key) or []
        bad = next((p for p in curve if not (isinstance(p, (list, tuple)) and len(p) == 2 and _finite(p[1]))), None)
        if bad is not None or not isinstance(curve, list):
            raise ResultsError(f"{path}: {key} holds {bad if bad is not None else curve!r}, not [step, finite loss]: "
                               f"the file is damaged; {_FIX}")


def _read(path: Path) -> dict | None:
    """The results dict in ``path``; None for a JSON that is no run's results (a memory plan)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e}); {_FIX}") from None
    try:
        res = json.loads(text)
    except ValueError as e:
        what = "empty" if not text.strip() else f"not valid JSON (truncated? {e})"
        raise ResultsError(f"{path} is {what}: the report would leave this run out of every table; {_FIX}") from None
    if not (isinstance(res, dict) and "val_loss" in res and "method" in res):
        return None
    _check_losses(path, res)
    _check_fields(path, res)
    return res


def load_results(root: str | Path, results: str | Path = "reports/results", dedupe: bool = True) -> list[dict]:
    """Rows of every results JSON under ``<root>/<results>``, sorted by :func:`sort_key`; ``dedupe``: one row per
    :func:`run_key` among the reported runs (the first declared study keeps a configuration two share)."""
    base = Path(root) / results
    found, groups = [], declared()
    for path in sorted(base.rglob("*.json")) if base.is_dir() else []:
        res = _read(path)
        if res is not None:
            folder = path.parent.relative_to(base).as_posix() if path.parent != base else ""
            found.append(row_from_result(res, groups.study_of(folder)))
    order = groups.studies()            # undeclared folders last
    found.sort(key=lambda r: (order.index(r["group"]) if r["group"] in order else len(order), r["group"], r["run"]))
    rows, seen = [], set()
    for r in found:
        # a redraw repeats a reported study's configurations on purpose: keyed by its own group, never deduplicated
        reported = not r["eval_offset"] and groups.role_of_study(r["group"]) not in APART_ROLES
        key = (r["profile"], *run_key(r)) if dedupe and reported else (r["group"], r["run"])
        if key not in seen:
            seen.add(key)
            rows.append(r)
    return sorted(rows, key=sort_key)


def sort_key(r: dict) -> tuple:
    m = r["method"]
    return (str(r["model"]), r.get("stages") or 0, METHOD_ORDER.index(m) if m in METHOD_ORDER else 99,
            r.get("variant", m), r.get("wire_ratio") or 0, r.get("steps") or 0, r.get("seed") or 0, r.get("run", ""))


def select(rows: Iterable[dict], profile: str | None = None, eval_offset: int | None = 0, tuning: bool = False,
           other_corpus: bool = False, **eq) -> list[dict]:
    """Rows of ``profile`` at ``eval_offset`` (None: any) with ``row[k] == v``, with a loss, never a redraw; the
    tuning and other-corpus studies only if asked."""
    out, groups = [], declared()
    left_out = {*APART_ROLES, *(() if other_corpus else ("other-corpus",))} - ({"tuning"} if tuning else set())
    for r in rows:
        if r.get("val_loss") is None or (profile and r["profile"] != profile):
            continue
        if groups.role_of_study(r.get("group", "")) in left_out:
            continue
        if eval_offset is not None and (r.get("eval_offset") or 0) != eval_offset:
            continue
        if all(r.get(k) == v for k, v in eq.items()):
            out.append(r)
    return out


def report_selections(loaded: Iterable[dict], profile: str) -> tuple[list[dict], list[dict], list[dict]]:
    """``rows_all`` (every run), ``rows`` (the reported runs) and ``corpus_rows`` (those plus the other corpus)."""
    loaded = list(loaded)
    rows_all = select(loaded, profile=profile, eval_offset=None, tuning=True, other_corpus=True)
    return rows_all, select(loaded, profile=profile), select(loaded, profile=profile, other_corpus=True)


def redrawn_rows(loaded: Iterable[dict], profile: str) -> list[dict]:
    """The profile's redraw rows, ``group`` the study they draw again, ``draw`` their own (never pooled)."""
    groups = declared()
    return [{**r, "group": groups.redrawn_study(r["group"]), "draw": r["group"]} for r in loaded
            if r.get("val_loss") is not None and r["profile"] == profile
            and groups.role_of_study(r.get("group", "")) == "redraw"]


def is_reference(r: dict) -> bool:
    """A plain uncompressed run: the only Δ% reference (an uncompressed run with anchors is none)."""
    return r["method"] == "none" and r.get("variant", "none") == "none"


def is_default(r: dict) -> bool:
    """The method at its default projector and anchor (and streamed codebook sync)."""
    return r["variant"] == r["method"]


def rescored_rows(rows: Sequence[dict], rescores: dict[str, dict], set_name: str | None = None) -> list[dict]:
    """The rows of the runs scored, ``val_loss`` their score on ``set_name`` (None: kept), curves dropped."""
    out = []
    for r in rows:
        entry = rescores.get(r["run"])
        if not entry or entry.get("val_loss") != r.get("val_loss"):
            continue
        if set_name is not None and set_name not in entry["scores"]:
            continue
        loss = r["val_loss"] if set_name is None else entry["scores"][set_name]
        out.append({**r, "val_loss": loss, "val_loss_curve": [], "select_loss": None, "select_loss_curve": []})
    return out


# MAPL's ingredients at their defaults (projector, anchor): what an ablation varies one of, read from the method
# table so that a change of default there moves every ablation table and ledger row with it
MAPL_DEFAULTS = {k: METHODS["mapl"][k] for k in ("projector", "anchor")}


def setting_of(r: dict) -> tuple:
    """(model, P, projection ratio, steps): the setting an ablation or a control is read at."""
    return r["model"], r["stages"], r["projection_ratio"], r["steps"]


def run_key(r: dict, with_seed: bool = True) -> tuple:
    """The configuration (:data:`KEY`), with or without the seed."""
    return tuple(r.get(k) for k in (KEY if with_seed else KEY[:-1]))


def group_runs(rows: Iterable[dict], with_seed: bool = False) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[run_key(r, with_seed)].append(r)
    return dict(out)


def main_model(rows: Sequence[dict]) -> str | None:
    """The profile's main model: the override-free model with the most ``main`` runs (else of all); ties by name."""
    pool = [r for r in rows if "[" not in r["model"]]
    counts = Counter(r["model"] for r in pool if r["group"] == "main") or Counter(r["model"] for r in pool)
    return min(counts, key=lambda m: (-counts[m], m)) if counts else None


def budget_steps(rows: Sequence[dict], group: str, model: str | None = None) -> int | None:
    """A group's budget: its most common step count (ties: the smaller), of ``model``'s runs if given."""
    counts = Counter(r["steps"] for r in rows if r["group"] == group and (model is None or r["model"] == model))
    return min(counts, key=lambda s: (-counts[s], s)) if counts else None


def at_projection_ratio(rows: Iterable[dict], ratio: float | None) -> list[dict]:
    """The rows at projection ratio ``ratio`` and those without one (None: all)."""
    return [r for r in rows if ratio is None or r["projection_ratio"] in (None, ratio)]


def at_best_validation(rows: Iterable[dict]) -> list[dict]:
    """Each row at its best step (chosen on the selection curve where there is one, so as not to flatter it)."""
    out = []
    for r in rows:
        curve = r.get("val_loss_curve") or [[r["steps"], r["val_loss"]]]
        chooser = r.get("select_loss_curve") or curve
        step = min(chooser, key=lambda point: point[1])[0]
        best = dict((s, v) for s, v in curve).get(step, r["val_loss"])
        out.append({**r, "val_loss": best, "best_step": step, "final_val_loss": r["val_loss"],
                    "best_chosen_on": "selection set" if r.get("select_loss_curve") else "report set"})
    return out


def boundary_mean(runs: Iterable[dict], key: str) -> float | None:
    """Mean of ``key`` over every boundary's geometry diagnostics of ``runs`` (None without any)."""
    values = [d[key] for r in runs for d in r.get("boundary_diagnostics") or [] if "captured_energy" in d]
    return statistics.fmean(values) if values else None


def train_split_tokens(root: str | Path, profile: str) -> int | None:
    """Tokens in the profile's training split (``data/<profile>.manifest.json``; None if absent)."""
    path = Path(root) / "data" / f"{profile}.manifest.json"
    try:
        return int(json.loads(path.read_text())["splits"]["train"]["tokens"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
