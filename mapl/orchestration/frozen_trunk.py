"""When does learning the subspace pay? Boundaries inserted into a trained, frozen uncompressed model.

Only the projectors A_p and the anchors train, per projector (``spel``, ``fixed``, ``unconstrained``); a tuned
projector's candidates run on the first seed and the lowest *selection* loss runs on every seed (``tuning.json``).
docs/reproducing.md describes the study; its outputs are ``reports/<profile>/frozen-trunk/``, written whole.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..base.io import atomic_write_bytes, atomic_write_json, read_json_object
from ..core.config import PROJECT_ROOT, PROJECTORS, ConfigError, RunConfig, config_hash, load_params
from ..core.fingerprint import code_fingerprint
from . import sweep

__all__ = ["STUDIED", "TRAINABLE", "FrozenTrunkSettings", "settings", "study_dir", "trunk_specs", "trunk_configs",
           "boundary_config", "candidates", "choose", "frozen_engine", "train_frozen",
           "run_study"]

STUDIED = ("spel", "fixed", "unconstrained")
TRAINABLE = ("boundaries.", "anchors.")          # what trains on the frozen trunk
KEYS = ("seeds", "trunk", "boundaries", "projectors", "tune")
SET_BY_STUDY = ("train.seed", "projector", "name")


@dataclass(frozen=True)
class FrozenTrunkSettings:
    seeds: tuple[int, ...] = ()
    trunk: dict | None = None           # run spec of the uncompressed trunk (the seed is added per seed)
    boundaries: dict | None = None      # run spec of the boundary training (projector and seed added)
    projectors: tuple[str, ...] = STUDIED
    # projector -> overrides of `boundaries` tried on the first seed besides `boundaries` itself (:func:`choose`)
    tune: dict[str, tuple[dict, ...]] = field(default_factory=dict)


def settings(profile: str, params: dict | None = None) -> FrozenTrunkSettings:
    """The profile's study, validated (one-line ``ConfigError``s); no entry or no seeds: nothing to run."""
    params = params or load_params()
    where = f"frozen_trunk.{profile}"
    raw = (params.get("frozen_trunk") or {}).get(profile)
    if raw is None:
        return FrozenTrunkSettings()
    if not isinstance(raw, dict) or set(raw) - set(KEYS):
        extra = sorted(set(raw) - set(KEYS)) if isinstance(raw, dict) else raw
        raise ConfigError(f"{where}: {extra!r} is invalid: allowed keys {list(KEYS)}")
    seeds = raw.get("seeds") or []
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise ConfigError(f"{where}.seeds = {seeds!r} is invalid: must be a list of integers >= 0")
    projectors = raw.get("projectors", list(STUDIED))
    if not isinstance(projectors, list) or not projectors or any(p not in PROJECTORS for p in projectors):
        raise ConfigError(f"{where}.projectors = {projectors!r} is invalid: a non-empty list of {list(PROJECTORS)}")
    specs = {}
    for key, method in (("trunk", "none"), ("boundaries", "mapl")):
        spec = raw.get(key) or {}
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}.{key} = {spec!r} is invalid: must be a run spec (a mapping)")
        if spec.get("method", method) != method:
            raise ConfigError(f"{where}.{key}.method = {spec['method']!r} is invalid: must be {method!r}")
        for fixed in SET_BY_STUDY:
            if fixed in spec:
                raise ConfigError(f"{where}.{key}.{fixed} is invalid: the study sets it (seeds, projectors)")
        specs[key] = {**spec, "method": method}
    tune = _tune_setting(where, raw.get("tune") or {}, projectors)
    st = FrozenTrunkSettings(tuple(seeds), specs["trunk"], specs["boundaries"], tuple(projectors), tune)
    for seed in st.seeds[:1]:                     # every spec resolves (bad keys and values named by the config)
        try:
            trunk = trunk_configs(profile, st, params)[0]
        except ConfigError as e:
            raise ConfigError(f"{where}.trunk ({st.trunk}): {e}") from None
        for proj in st.projectors:
            for k, over in enumerate(candidates(st, proj)):
                spec = f"{where}.tune.{proj}[{k - 1}] ({over})" if k else f"{where}.boundaries ({st.boundaries})"
                try:
                    boundary_config(profile, st, seed, proj, trunk, params, over)
                except ConfigError as e:
                    msg = str(e)
                    raise ConfigError(msg if msg.startswith(where) else f"{spec}: {msg}") from None
    return st


def _tune_setting(where: str, raw, projectors) -> dict[str, tuple[dict, ...]]:
    if not isinstance(raw, dict) or set(raw) - set(projectors):
        extra = sorted(set(raw) - set(projectors)) if isinstance(raw, dict) else raw
        raise ConfigError(f"{where}.tune: {extra!r} is invalid: a mapping from a studied projector "
                          f"({list(projectors)}) to a list of overrides of `boundaries`")
    out = {}
    for proj, overs in raw.items():
        if not isinstance(overs, list) or not overs or not all(isinstance(o, dict) and o for o in overs):
            raise ConfigError(f"{where}.tune.{proj} = {overs!r} is invalid: a non-empty list of non-empty mappings "
                              "(overrides of `boundaries`, e.g. {compressor.projector.lr_mult: 0.3})")
        for o in overs:
            for fixed in (*SET_BY_STUDY, "method"):
                if fixed in o:
                    raise ConfigError(f"{where}.tune.{proj}: {fixed} is invalid in an override: the study sets it")
        out[proj] = tuple(overs)
    return out


def study_dir(profile: str, root: Path = PROJECT_ROOT) -> Path:
    return Path(root) / "reports" / profile / "frozen-trunk"


def trunk_specs(st: FrozenTrunkSettings) -> list[dict]:
    """The sweep spec of each seed's trunk: ``{**trunk, train.seed}``."""
    return [{**st.trunk, "train.seed": s} for s in st.seeds]


def trunk_configs(profile: str, st: FrozenTrunkSettings, params: dict | None = None) -> list[RunConfig]:
    """The trunk of each seed, named as the sweep names it (a group training the same run shares its checkpoint)."""
    return [sweep.spec_config(profile, spec, params).validate() for spec in trunk_specs(st)]


def candidates(st: FrozenTrunkSettings, projector: str) -> list[dict]:
    """The settings a projector is tuned over: ``{}`` (the boundary spec itself) and each override of ``tune``."""
    return [{}, *st.tune.get(projector, ())]


def _suffix(override: dict) -> str:
    """``{compressor.projector.lr_mult: 0.3}`` -> ``-lr_mult0.3``: a candidate's part of its run name."""
    return "".join(f"-{key.rsplit('.', 1)[-1]}{value:g}" if isinstance(value, float) else f"-{key.rsplit('.', 1)[-1]}{value}"
                   for key, value in sorted(override.items()))


def boundary_config(profile: str, st: FrozenTrunkSettings, seed: int, projector: str, trunk: RunConfig,
                    params: dict | None = None, override: dict | None = None) -> RunConfig:
    """The boundary run of ``seed`` and ``projector`` (with a candidate's ``override``), named ``frozen-<run>``."""
    override = override or {}
    cfg = sweep.spec_config(profile, {**st.boundaries, **override, "projector": projector, "train.seed": seed},
                            params).validate()
    if cfg.model != trunk.model or cfg.stages != trunk.stages or cfg.data != trunk.data:
        raise ConfigError(f"frozen_trunk.{profile}.boundaries: model, stages and data must be the trunk's "
                          f"({trunk.name()}): the boundaries are inserted into it")
    base = cfg.name().removesuffix(f"-s{seed}")
    return replace(cfg, run_name=f"frozen-{base}{_suffix(override)}-s{seed}")


def choose(results: list[dict]) -> int:
    """Index of the candidate with the lowest finite selection loss (the first, the boundary spec, wins a tie)."""
    scored = [(r["select_loss"], k) for k, r in enumerate(results) if r and isinstance(r.get("select_loss"), float)
              and math.isfinite(r["select_loss"])]
    if not scored:
        raise RuntimeError("no tuning candidate has a finite selection loss (train.eval_tokens with a selection split?)")
    return min(scored)[1]


def frozen_engine(cfg: RunConfig, trunk_state: dict):
    """``cfg``'s staged model with the trunk's weights loaded and frozen: only A_p and the anchors train."""
    from ..core.engine import LocalEngine, build_optimizers
    eng = LocalEngine.build(cfg)
    missing, unexpected = eng.sm.load_state_dict(trunk_state, strict=False)
    if unexpected or any(not k.startswith(TRAINABLE) for k in missing):
        raise ValueError(f"the trunk does not fit {cfg.name()}: unexpected {unexpected[:3]}, missing "
                         f"{[k for k in missing if not k.startswith(TRAINABLE)][:3]} (the trunk must be method none "
                         "of the same model)")
    for name, p in eng.sm.named_parameters():
        p.requires_grad_(name.startswith(TRAINABLE))
    eng.opts = build_optimizers(eng.sm, cfg)         # only what requires grad
    return eng


def _trunk_state(ckpt: Path) -> dict:
    from ..core.checkpoint import read as read_checkpoint
    return {k: v for k, v in read_checkpoint(ckpt)["model"].items() if k.startswith("model.")}


def train_frozen(cfg: RunConfig, trunk_state: dict) -> dict:
    """Train the boundaries of ``cfg`` on the frozen trunk; the results dict."""
    import torch

    from ..core.loop import lr_factor
    eng = frozen_engine(cfg, trunk_state)
    t = cfg.train
    before = eng.evaluate(0)
    train_curve, val_curve, select_curve, t0 = [], [], [], time.time()
    for step in range(t.steps):
        out = eng.train_step(step, lr_factor(step, cfg))
        if not math.isfinite(out.loss):
            raise FloatingPointError(f"{cfg.name()}: non-finite loss at step {step} ({out.nonfinite_at})")
        train_curve.append([step, out.loss])
        if (step + 1) % t.eval_every == 0 or step + 1 == t.steps:
            ev = eng.evaluate(step + 1)
            val_curve.append([step + 1, ev.val])
            if ev.select is not None:
                select_curve.append([step + 1, ev.select])
    state = eng.sm.state_dict()
    moved = [k for k, v in trunk_state.items() if not torch.equal(state[k], v)]
    if moved:
        raise AssertionError(f"{cfg.name()}: trunk weights changed during training: {moved[:3]}")
    return {"run": cfg.name(), "method": cfg.compressor.method, "projector": cfg.compressor.resolved().projector.kind,
            "ratio": cfg.compressor.ratio, "seed": t.seed, "steps": t.steps,
            "trainable_params": sum(p.numel() for p in eng.sm.parameters() if p.requires_grad),
            "val_before": before.val, "select_before": before.select, "val_loss": val_curve[-1][1],
            "select_loss": select_curve[-1][1] if select_curve else None, "val_loss_curve": val_curve,
            "select_loss_curve": select_curve, "train_loss_curve": train_curve, "wall_s": round(time.time() - t0, 1)}


@dataclass(frozen=True)
class _Task:
    """One boundary run: its config and candidate override, its trunk, where its results go."""
    cfg: RunConfig
    override: dict
    trunk: RunConfig
    trunk_ckpt: Path
    trunk_val: float
    out: Path
    fingerprint: str


def _worker(task: _Task) -> dict:
    import torch
    cfg = task.cfg
    torch.set_num_threads(cfg.train.threads or 1)
    try:
        res = train_frozen(cfg, _trunk_state(task.trunk_ckpt))
    except Exception as e:           # noqa: BLE001 -- one failed run must not take the study down; it is reported
        return {"run": cfg.name(), "error": f"{type(e).__name__}: {e}"}
    res["override"] = task.override
    res["trunk"] = {"run": task.trunk.name(), "config_hash": config_hash(task.trunk), "steps": task.trunk.train.steps,
                    "val_loss": task.trunk_val}
    res["delta_pct"] = 100 * (res["val_loss"] - task.trunk_val) / task.trunk_val
    res["provenance"] = {"config_hash": config_hash(cfg), "code_fingerprint": task.fingerprint}
    atomic_write_json(task.out, res)
    return {"run": cfg.name(), "val_loss": res["val_loss"], "select_loss": res["select_loss"],
            "delta_pct": res["delta_pct"]}


def _trunks(profile: str, st: FrozenTrunkSettings, params: dict, root: Path) -> list[tuple[RunConfig, Path, float]]:
    """(config, checkpoint, val loss) of every trunk, trained first (or restored from its checkpoint)."""
    specs, cfgs = trunk_specs(st), trunk_configs(profile, st, params)
    out_dir = study_dir(profile, root) / "trunks"
    ckpts = [sweep.checkpoint_path(profile, c.name()) for c in cfgs]
    sweep.train_pool(profile, specs, out_dir, params=params)
    return [(c, k, read_json_object(out_dir / f"{c.name()}.json")["val_loss"]) for c, k in zip(cfgs, ckpts)]


def _run_tasks(tasks: list[_Task], workers: int, log) -> list[dict]:
    """Train ``tasks`` in a spawn pool (``workers`` side by side); the status of each, logged as it ends."""
    if not tasks:
        return []
    status = []
    with mp.get_context("spawn").Pool(min(workers, len(tasks)), maxtasksperchild=1) as pool:
        for st_ in pool.imap_unordered(_worker, tasks):
            log(f"  {st_['run']}: " + (st_["error"] if "error" in st_ else f"val {st_['val_loss']:.4f} "
                                        f"({st_['delta_pct']:+.2f} % against its trunk)"))
            status.append(st_)
    return status


def run_study(profile: str, params: dict | None = None, root: Path = PROJECT_ROOT, jobs: int = 0, log=print) -> list[dict]:
    """Train the profile's study into its folder, written whole; the status of each boundary run. Raises naming
    every run that failed."""
    params = params or load_params()
    st = settings(profile, params)
    out_dir = study_dir(profile, root)
    shutil.rmtree(out_dir, ignore_errors=True)          # as DVC does before the stage: no result of another study
    out_dir.mkdir(parents=True)
    if not st.seeds:
        (out_dir / ".gitkeep").write_text("")
        log(f"frozen_trunk.{profile} has no seeds: nothing to run")
        return []
    fingerprint = code_fingerprint()
    trunks = _trunks(profile, st, params, root)
    workers = jobs or sweep.launcher_config(profile, params).jobs or 1
    first = st.seeds[0]

    def task(seed, proj, over, trunk, folder):
        cfg = boundary_config(profile, st, seed, proj, trunk[0], params, over)
        return _Task(cfg, over, trunk[0], trunk[1], trunk[2], folder / f"{cfg.name()}.json", fingerprint)

    # the first seed: every candidate of a tuned projector (under tune/), every run of the others
    tuned = [p for p in st.projectors if p in st.tune]
    tune_tasks = {p: [task(first, p, o, trunks[0], out_dir / "tune") for o in candidates(st, p)] for p in tuned}
    if tuned:
        (out_dir / "tune").mkdir(exist_ok=True)
    untuned = [task(s, p, {}, tr, out_dir) for s, tr in zip(st.seeds, trunks) for p in st.projectors if p not in st.tune]
    todo = [t for ts in tune_tasks.values() for t in ts] + untuned
    n_candidates = sum(map(len, tune_tasks.values()))
    log(f"frozen trunk: {len(todo) + (len(st.seeds) - 1) * len(tuned)} boundary run(s)"
        + (f" ({n_candidates} tuning candidates on seed {first})" if tuned else "")
        + f", {len(todo)} to train" + (" first" if tuned else ""))
    status = _run_tasks(todo, workers, log)
    _raise_failed(status)                       # a failed candidate must not lose the tuning to the others

    # the winners: the first seed's copied from its candidate, the other seeds trained
    tuning, winners = {}, []
    for proj, ts in tune_tasks.items():
        results = [read_json_object(t.out) for t in ts]
        best = ts[choose(results)]
        tuning[proj] = {"seed": first, "scored_on": "selection split", "chosen": best.override,
                        "candidates": [{"override": t.override, "run": t.cfg.name(),
                                        "select_loss": (r or {}).get("select_loss"), "val_loss": (r or {}).get("val_loss")}
                                       for t, r in zip(ts, results)]}
        log(f"  {proj}: tuned on seed {first}'s selection split -> {best.override or 'the boundary spec'}")
        final = task(first, proj, best.override, trunks[0], out_dir)
        atomic_write_bytes(final.out, best.out.read_bytes())   # the same config on the same trunk: the same numbers
        winners += [task(s, proj, best.override, tr, out_dir) for s, tr in zip(st.seeds[1:], trunks[1:])]
    if tune_tasks:
        atomic_write_json(out_dir / "tuning.json", tuning)
    status += _run_tasks(winners, workers, log)
    _raise_failed(status)
    return status


def _raise_failed(status: list[dict]) -> None:
    failed = [s for s in status if "error" in s]
    if failed:
        raise RuntimeError(f"{len(failed)} frozen-trunk run(s) failed: " + "; ".join(f"{s['run']}: {s['error']}" for s in failed))
