"""When does learning the subspace pay? Boundaries inserted into a trained, frozen uncompressed model (issue 26).

Under joint training the stages can rotate what matters into whatever subspace they are given, so a
fixed random projector ties SPEL (the headline's fixed − MAPL). Without co-adaptation they cannot: here
the trunk (every weight of an uncompressed run trained first) is frozen, MAPL's boundaries are inserted
at every stage boundary, and only the projectors A_p and the factorized anchors train:

    spel             learned on the Stiefel manifold (SPEL), the paper's
    fixed            a random orthonormal basis per boundary, never trained (only the anchors train)
    unconstrained    learned without the constraint (Muon, the ablation's optimiser)

The study is ``frozen_trunk.<profile>`` in params.yaml (:func:`settings`): the seeds, the trunk's
run spec (an uncompressed run, trained by :func:`mapl.orchestration.sweep.run_many` like any group, so it
is restored from its checkpoint when one exists), the spec of the boundary training (a mapl run: its
method's tuned settings, its own warm-up and decay) and the projectors. Every boundary run is one
process of a spawn pool (the profile's ``launcher.jobs`` side by side) and writes its results JSON as
soon as it ends, so an interrupted study resumes where it stopped (:func:`current`). Everything goes to
``reports/<profile>/frozen-trunk/``: ``trunks/<run>.json`` and one ``frozen-<run>.json`` per seed and projector
(read by :mod:`mapl.report.frozen`).

    python -m mapl.frozen_trunk --profile cpu     # the profile's study (DVC stage frozen_trunk)
"""
from __future__ import annotations

import math
import multiprocessing as mp
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..base.io import atomic_write_json, read_json_object
from ..core.config import PROJECT_ROOT, PROJECTORS, ConfigError, RunConfig, config_hash, load_params
from ..core.fingerprint import code_fingerprint
from . import sweep

__all__ = ["STUDIED", "TRAINABLE", "FrozenTrunkSettings", "settings", "study_dir", "trunk_configs",
           "boundary_config", "study_fingerprint", "current", "frozen_engine", "train_frozen", "run_study"]

STUDIED = ("spel", "fixed", "unconstrained")
TRAINABLE = ("boundaries.", "anchors.")          # what trains on the frozen trunk
KEYS = ("seeds", "trunk", "boundaries", "projectors")


@dataclass(frozen=True)
class FrozenTrunkSettings:
    seeds: tuple[int, ...] = ()
    trunk: dict | None = None           # run spec of the uncompressed trunk (the seed is added per seed)
    boundaries: dict | None = None      # run spec of the boundary training (projector and seed added)
    projectors: tuple[str, ...] = STUDIED


def settings(profile: str, params: dict | None = None) -> FrozenTrunkSettings:
    """The profile's study, validated; a profile without an entry (or with no seeds) runs nothing.
    Each bad value is a :class:`ConfigError` naming its field and what is allowed."""
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
        for fixed in ("train.seed", "projector", "name"):
            if fixed in spec:
                raise ConfigError(f"{where}.{key}.{fixed} is invalid: the study sets it (seeds, projectors)")
        specs[key] = {**spec, "method": method}
    st = FrozenTrunkSettings(tuple(seeds), specs["trunk"], specs["boundaries"], tuple(projectors))
    for seed in st.seeds[:1]:                     # every spec resolves (bad keys and values named by the config)
        try:
            trunk = trunk_configs(profile, st, params)[0]
        except ConfigError as e:
            raise ConfigError(f"{where}.trunk ({st.trunk}): {e}") from None
        for proj in st.projectors:
            try:
                boundary_config(profile, st, seed, proj, trunk, params)
            except ConfigError as e:
                msg = str(e)
                raise ConfigError(msg if msg.startswith(where) else f"{where}.boundaries ({st.boundaries}): {msg}") from None
    return st


def study_dir(profile: str, root: Path = PROJECT_ROOT) -> Path:
    return Path(root) / "reports" / profile / "frozen-trunk"


def trunk_configs(profile: str, st: FrozenTrunkSettings, params: dict | None = None) -> list[RunConfig]:
    """The trunk of each seed: the sweep's config of ``{**trunk, train.seed}`` (named as the sweep names it,
    so a group that trains the same run shares its checkpoint)."""
    return [sweep.spec_config(profile, {**st.trunk, "train.seed": s}, params).validate() for s in st.seeds]


def boundary_config(profile: str, st: FrozenTrunkSettings, seed: int, projector: str, trunk: RunConfig,
                    params: dict | None = None) -> RunConfig:
    cfg = sweep.spec_config(profile, {**st.boundaries, "projector": projector, "train.seed": seed}, params).validate()
    if cfg.model != trunk.model or cfg.stages != trunk.stages or cfg.data != trunk.data:
        raise ConfigError(f"frozen_trunk.{profile}.boundaries: model, stages and data must be the trunk's "
                          f"({trunk.name()}): the boundaries are inserted into it")
    return replace(cfg, run_name=f"frozen-{cfg.name()}")


def study_fingerprint() -> str:
    """The training code's fingerprint and this module's content (its loop computes the boundary runs' numbers,
    and orchestration is not among the fingerprinted sources): a boundary run is current only under both."""
    import hashlib
    own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return f"{code_fingerprint()}+{own}"


def current(out: Path, cfg: RunConfig, trunk: RunConfig, fingerprint: str) -> bool:
    """The boundary run's results at ``out`` are this config's, on this trunk, from this training code."""
    res = read_json_object(out)
    prov = (res or {}).get("provenance") or {}
    return (res is not None and prov.get("config_hash") == config_hash(cfg) and prov.get("code_fingerprint") == fingerprint
            and (res.get("trunk") or {}).get("config_hash") == config_hash(trunk))


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
    """Train the boundaries of ``cfg`` on the frozen trunk; the results dict (losses on the report set, the
    selection set beside them)."""
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


def _worker(task) -> dict:
    cfg, trunk_cfg, trunk_ckpt, trunk_val, out, fingerprint = task
    import torch
    torch.set_num_threads(cfg.train.threads or 1)
    try:
        res = train_frozen(cfg, _trunk_state(trunk_ckpt))
    except Exception as e:           # noqa: BLE001 -- one failed run must not take the study down; it is reported
        return {"run": cfg.name(), "error": f"{type(e).__name__}: {e}"}
    res["trunk"] = {"run": trunk_cfg.name(), "config_hash": config_hash(trunk_cfg), "steps": trunk_cfg.train.steps,
                    "val_loss": trunk_val}
    res["delta_pct"] = 100 * (res["val_loss"] - trunk_val) / trunk_val
    res["provenance"] = {"config_hash": config_hash(cfg), "code_fingerprint": fingerprint}
    atomic_write_json(out, res)
    return {"run": cfg.name(), "val_loss": res["val_loss"], "delta_pct": res["delta_pct"]}


def _trunks(profile: str, st: FrozenTrunkSettings, params: dict, root: Path, log) -> list[tuple[RunConfig, Path, float]]:
    """(config, checkpoint, val loss) of every trunk, trained (or restored) by the sweep first. A trunk whose
    results are here but whose checkpoint is gone is trained again: the study needs its weights."""
    cfgs = trunk_configs(profile, st, params)
    out_dir = study_dir(profile, root) / "trunks"
    ckpts = [sweep.checkpoint_path(profile, c.name()) for c in cfgs]
    for cfg, ckpt in zip(cfgs, ckpts):
        if not ckpt.exists():
            (out_dir / f"{cfg.name()}.json").unlink(missing_ok=True)
    specs = [{**st.trunk, "train.seed": s} for s in st.seeds]
    sweep.run_many(profile, specs, out_dir, log=log, group="frozen-trunk trunks", progress_every=0)
    return [(c, k, read_json_object(out_dir / f"{c.name()}.json")["val_loss"]) for c, k in zip(cfgs, ckpts)]


def run_study(profile: str, params: dict | None = None, root: Path = PROJECT_ROOT, jobs: int = 0, log=print) -> list[dict]:
    """Train what the profile's study lacks (trunks, then every boundary run not :func:`current`); the
    status of each boundary run. Raises RuntimeError naming every run that failed."""
    params = params or load_params()
    st = settings(profile, params)
    out_dir = study_dir(profile, root)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not st.seeds:
        (out_dir / ".gitkeep").write_text("")
        log(f"frozen_trunk.{profile} has no seeds: nothing to run")
        return []
    fingerprint = study_fingerprint()
    trunks = _trunks(profile, st, params, root, log)
    tasks, status = [], []
    for seed, (tcfg, tckpt, tval) in zip(st.seeds, trunks):
        for proj in st.projectors:
            cfg = boundary_config(profile, st, seed, proj, tcfg, params)
            out = out_dir / f"{cfg.name()}.json"
            if current(out, cfg, tcfg, fingerprint):
                status.append({"run": cfg.name(), "skipped": "current"})
            else:
                tasks.append((cfg, tcfg, tckpt, tval, out, fingerprint))
    log(f"frozen trunk: {len(status) + len(tasks)} boundary run(s), {len(status)} current, {len(tasks)} to train")
    if tasks:
        workers = jobs or sweep.launcher_config(profile, params).jobs or 1
        with mp.get_context("spawn").Pool(min(workers, len(tasks)), maxtasksperchild=1) as pool:
            for st_ in pool.imap_unordered(_worker, tasks):
                log(f"  {st_['run']}: " + (st_["error"] if "error" in st_ else f"val {st_['val_loss']:.4f} "
                                            f"({st_['delta_pct']:+.2f} % against its trunk)"))
                status.append(st_)
    failed = [s for s in status if "error" in s]
    if failed:
        raise RuntimeError(f"{len(failed)} frozen-trunk run(s) failed: " + "; ".join(f"{s['run']}: {s['error']}" for s in failed))
    return status

