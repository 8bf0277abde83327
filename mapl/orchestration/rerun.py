"""A reviewer's rerun (``mapl rerun``): k seeds of a committed group trained again, judged against the committed
distribution by the rule of docs/protocol.md ("A reviewer's rerun"). :func:`judge` is a pure function of result
rows; :func:`rerun_group` trains what is missing and returns the rows to judge.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Sequence

from ..base.declared_groups import declaration
from ..base.io import OutputError
from ..core.config import PROJECT_ROOT, ConfigError, RunConfig, config_hash, load_params
from ..report.rows import is_reference, load_results, run_key
from ..report.stats import paired, summarize, t_quantile
from . import sweep
from .groups import group_specs, runs_of_seeds, spec_config

__all__ = ["LEVEL", "Tolerance", "Check", "rerun_dir", "group_rows", "measured_tolerance", "profile_tolerance",
           "judge", "same_run_differences", "format_judgement", "rerun_group"]

LEVEL = 0.95          # the prediction interval's level


@dataclass(frozen=True)
class Tolerance:
    """How far a rerun may stray beyond the committed seeds' spread: points of Δ% and of a paired gap."""
    delta: float
    gap: float
    source: str


@dataclass(frozen=True)
class Check:
    """One configuration's Δ% (or one pair's gap) per seed, rerun and committed, and the interval it must lie in."""
    label: str
    rerun: dict[int, float]
    committed: dict[int, float]
    low: float
    high: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rerun.values())

    @property
    def consistent(self) -> bool:
        return self.low <= self.mean <= self.high


def rerun_dir(profile: str, group: str, root: Path = PROJECT_ROOT) -> Path:
    """``reports/scratch/rerun/<profile>/<group>``: git-ignored, never the committed results."""
    return Path(root) / "reports" / "scratch" / "rerun" / profile / group


def group_rows(results: Path, group: str, runs: set[str] | None = None) -> list[dict]:
    """The result rows in ``results/<group>`` (only ``runs`` where given), sorted as the report sorts them."""
    folder = Path(results) / group
    rows = load_results(folder, "", dedupe=False) if folder.is_dir() else []
    return [{**r, "group": group} for r in rows if runs is None or r["run"] in runs]


def _deltas(rows: Sequence[dict]) -> dict[tuple, tuple[str, dict[int, float]]]:
    """Compressed configuration -> (its label: the run name without the seed, seed -> Δ%) (report.stats's rule)."""
    out = {}
    for s in summarize(rows):
        if not is_reference(s) and s["deltas"]:
            out[run_key(s, with_seed=False)] = (re.sub(r"-s\d+$", "", s["runs"][0]), s["deltas"])
    return out


def _gaps(deltas: dict[tuple, tuple[str, dict[int, float]]]) -> dict[tuple, tuple[str, dict[int, float]]]:
    """Each pair of compressed configurations (a, b) in the report's order -> ("a − b", seed -> paired gap)."""
    out = {}
    for (ka, (la, a)), (kb, (lb, b)) in combinations(deltas.items(), 2):
        pair = paired(a, b)
        if pair:
            out[(ka, kb)] = (f"{la} − {lb}", dict(zip(pair["seeds"], pair["diffs"])))
    return out


def measured_tolerance(committed: Sequence[dict], redraw: Sequence[dict], source: str) -> Tolerance | None:
    """The largest |redraw − committed| over matched (configuration, seed): of Δ%, and of each paired gap (without a
    pair in both, the triangle bound: twice Δ%'s). None when nothing matches."""
    def largest(ours: dict, theirs: dict) -> list[float]:
        return [abs(theirs[k][1][s] - v) for k, (_, seeds) in ours.items() if k in theirs
                for s, v in seeds.items() if s in theirs[k][1]]
    c, d = _deltas(committed), _deltas(redraw)
    delta = largest(c, d)
    if not delta:
        return None
    gap = largest(_gaps(c), _gaps(d))
    how = f"{len(delta)} matched runs, {len(gap)} matched gaps" if gap else f"{len(delta)} matched runs, no gap"
    return Tolerance(max(delta), max(gap) if gap else 2 * max(delta), f"{source} ({how})")


def profile_tolerance(profile: str, results: Path, params: dict) -> Tolerance | None:
    """The cross-machine spread the profile's committed redraw groups measure (None without their results)."""
    decl = declaration(params)
    rows_c, rows_d, names = [], [], []
    for name, g in decl.groups.items():
        redraw = group_rows(results, name) if g.role == "redraw" else []
        if redraw:
            names.append(f"{name} against {g.redraws}")
            rows_d += redraw
            rows_c += [r for other in decl.groups_of(g.redraws) for r in group_rows(results, other)]
    if not names:
        return None
    return measured_tolerance(rows_c, rows_d, f"measured on {results}: the largest difference, redraw against "
                                              f"committed, of {', '.join(names)}")


def _check(label: str, committed: dict[int, float], rerun: dict[int, float], tol: float) -> Check:
    """committed mean ± (t · sd · sqrt(1/k + 1/n) + tol); with one committed seed no spread is known: ± tol."""
    n, k = len(committed), len(rerun)
    mean = statistics.fmean(committed.values())
    half = (t_quantile(0.5 + LEVEL / 2, n - 1) * statistics.stdev(committed.values()) * math.sqrt(1 / k + 1 / n)
            if n >= 2 else 0.0)
    return Check(label, rerun, committed, mean - half - tol, mean + half + tol)


def judge(committed: Sequence[dict], rerun: Sequence[dict], tol: Tolerance) -> list[Check]:
    """Per compressed configuration of the rerun its mean Δ%, then per pair its mean paired gap, each against the
    committed seeds' prediction interval for the mean of k new seeds, widened by the tolerance."""
    c, r = _deltas(committed), _deltas(rerun)
    checks = [_check(*c[k], seeds, tol.delta) for k, (_, seeds) in r.items() if k in c]
    cg = _gaps(c)
    checks += [_check(*cg[k], seeds, tol.gap) for k, (_, seeds) in _gaps(r).items() if k in cg]
    return checks


def same_run_differences(committed: Sequence[dict], rerun: Sequence[dict]) -> list[tuple[str, float, float]]:
    """(run, rerun val loss, committed val loss) per rerun run of the same name (0 difference on the same machine)."""
    ours = {r["run"]: r["val_loss"] for r in committed}
    return [(r["run"], r["val_loss"], ours[r["run"]]) for r in rerun if r["run"] in ours]


def _seeds(values: dict[int, float]) -> str:
    return " ".join(f"s{s} {v:+.2f}" for s, v in sorted(values.items()))


def format_judgement(checks: Sequence[Check], same: Sequence[tuple[str, float, float]], tol: Tolerance) -> str:
    """What ``mapl rerun`` prints: the tolerance and its source, each run's loss against its committed twin, each
    check with its verdict, and the overall verdict."""
    lines = [f"tolerance: ±{tol.delta:.3f} points of Δ%, ±{tol.gap:.3f} points of a paired gap; {tol.source}",
             "val loss, rerun against committed (same run, same seed):"]
    lines += [f"  {name}  {a:.6f} vs {b:.6f}  ({100 * (a - b) / b:+.4f} %)" for name, a, b in same] or ["  (none)"]
    lines.append(f"Δ% against each seed's uncompressed run, and paired gaps (interval: {LEVEL:.0%} prediction for "
                 "the rerun's mean, widened by the tolerance):")
    for c in checks:
        values = list(c.committed.values())
        lines += [f"  {c.label}: {'consistent' if c.consistent else 'NOT CONSISTENT'}",
                  f"    rerun      {_seeds(c.rerun)}  mean {c.mean:+.2f}",
                  f"    committed  mean {statistics.fmean(values):+.2f}, range [{min(values):+.2f}, "
                  f"{max(values):+.2f}] over {len(values)} seed(s); accepted [{c.low:+.2f}, {c.high:+.2f}]"]
    bad = [c.label for c in checks if not c.consistent]
    lines.append(f"verdict: {'not consistent: ' + ', '.join(bad) if bad else 'consistent'} "
                 f"({len(checks) - len(bad)} of {len(checks)} checks inside)")
    return "\n".join(lines)


def _is_reference(cfg: RunConfig) -> bool:
    """A plain uncompressed run (no anchors either): the only Δ% reference (report.rows.is_reference for a config)."""
    c = cfg.compressor.resolved()
    return c.method == "none" and c.anchor.kind == "none"


def _check_group(profile: str, cfgs: list[RunConfig], seeds: list[int], group: str) -> None:
    """Each seed has its uncompressed reference run, and the group something compressed to judge."""
    plain = {c.train.seed for c in cfgs if _is_reference(c)}
    lacking = [s for s in seeds if s not in plain]
    if lacking:
        raise ConfigError(f"--group {group} is invalid for a rerun: profile {profile} has no uncompressed run of "
                          f"seed(s) {', '.join(map(str, lacking))} in it (Δ% needs the same seed's reference)")
    if all(map(_is_reference, cfgs)):
        raise ConfigError(f"--group {group} is invalid for a rerun: it has no compressed run to judge")


def rerun_group(profile: str, group: str, seeds: list[int], results: Path, out: Path,
                params: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Train the group's runs of ``seeds`` into ``out`` as committed (checkpoints beside them, resumed; a run whose
    results are there is not trained again); (the committed rows of the group, the rerun's rows)."""
    params = params or load_params()
    specs = runs_of_seeds(profile, group_specs(profile, group, params), seeds, params)
    cfgs = [spec_config(profile, s, params).validate() for s in specs]
    _check_group(profile, cfgs, seeds, group)
    committed = group_rows(results, group)
    if not committed:
        raise ConfigError(f"--results {results} is invalid: no committed results of group {group} in it")
    out = Path(out)
    if out.resolve().is_relative_to(Path(results).resolve()):
        raise OutputError(f"--out {out} is invalid: it is inside the committed results {results}; pick another folder")
    ours = {r["run"]: r for r in committed}
    names = {c.name() for c in cfgs}
    done = {r["run"]: r for r in group_rows(out.parent, out.name, names)}
    for cfg in cfgs:
        if ours.get(cfg.name(), {}).get("config_hash") != config_hash(cfg):
            raise ConfigError(f"{cfg.name()}: no committed result of this config in {Path(results) / group}: "
                              "params.yaml builds another config than was committed (git log params.yaml)")
        if cfg.name() in done and done[cfg.name()]["config_hash"] != config_hash(cfg):
            raise OutputError(f"{out / cfg.name()}.json is another config's rerun: delete it, or pick another --out")
    _train([(s, c) for s, c in zip(specs, cfgs) if c.name() not in done], profile, out, params)
    ours = group_rows(out.parent, out.name, names)
    if len(ours) != len(names):         # a launch that wrote nothing must not read as "consistent, 0 checks"
        raise RuntimeError(f"{out}: no results of {', '.join(sorted(names - {r['run'] for r in ours}))} after training")
    return committed, ours


def _train(todo: list[tuple[dict, RunConfig]], profile: str, out: Path, params: dict) -> None:
    """As the train stage trains them (the profile's launcher), but with checkpoints of their own under ``out``: the
    committed runs' checkpoints, where they are here, would only hand back the committed numbers."""
    ckpts = out / "checkpoints"
    if sweep.launcher_config(profile, params).kind == "pool":
        if todo:
            sweep.train_pool(profile, [s for s, _ in todo], out, params=params, ckpt_dir=ckpts)
        return
    for spec, cfg in todo:
        sweep.train_one(profile, cfg, spec, out / f"{cfg.name()}.json", ckpts / f"{cfg.name()}.pt")
