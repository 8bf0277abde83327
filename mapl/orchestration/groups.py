"""A profile's run groups: the run specs of each group, their configs and their names.

params.yaml declares every group once (top-level ``groups:``, :mod:`mapl.base.declared_groups`: study, role,
order); each profile lists every declared group under ``profiles.<p>.groups`` (an empty list trains
nothing). A group's entry is either a list of run specs, or a mapping

    runs:      the run specs
    defaults:  settings merged into every run (a run's own value wins), e.g. the budget
    seeds:     each run once per seed, seed by seed (runs x seeds); a run's ``name`` then holds ``{seed}``

A spec is a dict of overrides for :func:`mapl.core.config.load_run_config` (``method``, ``ratio``,
``projector``, ``anchor``, ``train.seed``, ``model.d_model``, ...) plus an optional ``name`` (default:
:func:`run_name`). Everything a group's runs resolve to is inside its own entry, so DVC's train stage
(params ``profiles.<p>.groups.<group>``) reruns exactly the group whose runs changed.

This is the bottom of the orchestration package: reuse, refresh, the sweep and the frozen-trunk study all
read groups from here, and it imports none of them.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..base.declared_groups import declaration
from ..core.config import METHODS, PROJECT_ROOT, ConfigError, RunConfig, RVQConfig, config_hash, load_params, load_run_config

__all__ = ["GROUP_KEYS", "SEED_FIELD", "results_dir", "group_names", "group_entry", "located_runs", "group_runs",
           "group_specs", "runs_of_seeds", "run_name", "spec_config", "check_names"]

GROUP_KEYS = ("runs", "defaults", "seeds")
SEED_FIELD = "train.seed"
SEED_PLACEHOLDER = "{seed}"


def results_dir(profile: str, group: str, root: Path = PROJECT_ROOT) -> Path:
    """``reports/<profile>/results/<group>``: profiles never write into each other's folders."""
    return Path(root) / "reports" / profile / "results" / group


def _profile_groups(profile: str, params: dict) -> dict:
    """``profiles.<profile>.groups``, holding exactly the declared groups; one line naming what is wrong."""
    if profile not in params["profiles"]:
        raise ConfigError(f"profile={profile!r} is invalid: allowed {sorted(params['profiles'])}")
    groups = (params["profiles"][profile] or {}).get("groups") or {}
    declared = declaration(params).names()
    extra = [g for g in groups if g not in declared]
    if extra:
        raise ConfigError(f"profiles.{profile}.groups.{extra[0]} is invalid: not declared in params.yaml `groups:` "
                          f"(declared: {', '.join(declared)})")
    missing = [g for g in declared if g not in groups]
    if missing:
        raise ConfigError(f"profiles.{profile}.groups lacks {', '.join(missing)}: every profile lists every declared "
                          "group (an empty list trains none)")
    return groups


def group_names(profile: str, params: dict | None = None) -> list[str]:
    """The profile's groups, in the declared order."""
    params = params or load_params()
    _profile_groups(profile, params)
    return list(declaration(params).names())


def group_entry(profile: str, group: str, params: dict | None = None):
    """``profiles.<profile>.groups.<group>`` as written (a list of specs, a mapping, or empty)."""
    groups = _profile_groups(profile, params or load_params())
    if group not in groups:
        raise ConfigError(f"group={group!r} is invalid for profile {profile!r}: allowed {sorted(groups)}")
    return groups[group]


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} = {value!r} is invalid: must be a mapping of settings (e.g. {{method: mapl, ratio: 8}})")
    return value


def _seeds(value, where: str) -> list[int]:
    ok = (isinstance(value, list) and value and len(set(value)) == len(value)
          and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value))
    if not ok:
        raise ConfigError(f"{where}.seeds = {value!r} is invalid: must be a non-empty list of distinct integers >= 0")
    return value


def _seeded(run: dict, seed: int, where: str) -> dict:
    """``run`` at ``seed``: ``train.seed`` set, ``{seed}`` in its name filled in."""
    if SEED_FIELD in run:
        raise ConfigError(f"{where}.{SEED_FIELD} is invalid: the group's `seeds:` sets it")
    name = run.get("name")
    return {**run, SEED_FIELD: seed, **({"name": name.replace(SEED_PLACEHOLDER, str(seed))} if name else {})}


def located_runs(entry, where: str) -> list[tuple[str, dict]]:
    """(where the run is written, its spec) of every run of a group's entry (the module docstring): a list as
    it is; a mapping's runs with its defaults merged in, once per seed (seed by seed) when it has ``seeds``."""
    if not entry:
        return []
    if isinstance(entry, list):
        located = [(f"{where}[{i}]", dict(_mapping(spec, f"{where}[{i}]"))) for i, spec in enumerate(entry)]
        for at, spec in located:
            _check_name(spec.get("name"), None, f"{at}.name")
        return located
    unknown = sorted(set(_mapping(entry, where)) - set(GROUP_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(GROUP_KEYS)} (or a list of run specs)")
    runs = entry.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ConfigError(f"{where}.runs = {runs!r} is invalid: must be a non-empty list of run specs")
    defaults = dict(_mapping(entry.get("defaults") or {}, f"{where}.defaults"))
    merged = [(f"{where}.runs[{i}]", {**defaults, **_mapping(run, f"{where}.runs[{i}]")}) for i, run in enumerate(runs)]
    seeds = _seeds(entry["seeds"], where) if "seeds" in entry else None
    for at, run in merged:
        _check_name(run.get("name"), seeds, f"{at}.name")
    if seeds is None:
        return merged
    if SEED_FIELD in defaults:
        raise ConfigError(f"{where}.defaults.{SEED_FIELD} is invalid: the group's `seeds:` sets it")
    return [(f"{at} seed {seed}", _seeded(run, seed, at)) for seed in seeds for at, run in merged]


def _check_name(name, seeds: list[int] | None, where: str) -> None:
    """A run named in a group of several seeds names each seed's run apart (``{seed}``); only there."""
    if name is None:
        return
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where} = {name!r} is invalid: must be a non-empty string")
    if seeds is None and SEED_PLACEHOLDER in name:
        raise ConfigError(f"{where} = {name!r} is invalid: {SEED_PLACEHOLDER} names a seed, and the group has no `seeds:`")
    if seeds is not None and len(seeds) > 1 and SEED_PLACEHOLDER not in name:
        raise ConfigError(f"{where} = {name!r} is invalid: the group has {len(seeds)} seeds, so the name must hold "
                          f"{SEED_PLACEHOLDER} (one name per run)")


def group_runs(profile: str, group: str, params: dict | None = None) -> list[tuple[str, dict]]:
    """(where it is written, spec) of every run of ``group`` in ``profile``, in training order."""
    params = params or load_params()
    return located_runs(group_entry(profile, group, params), f"profiles.{profile}.groups.{group}")


def group_specs(profile: str, group: str, params: dict | None = None) -> list[dict]:
    """The run specs of ``group`` in ``profile``, in training order (:func:`located_runs`)."""
    return [spec for _, spec in group_runs(profile, group, params)]


def runs_of_seeds(profile: str, specs: list[dict], seeds: list[int], params: dict | None = None) -> list[dict]:
    """The specs among ``specs`` whose run has one of ``seeds`` (splitting a group's seeds across machines);
    a seed that no run has is refused in one line."""
    params = params or load_params()
    have = [spec_config(profile, s, params).train.seed for s in specs]
    absent = [s for s in seeds if s not in have]
    if absent:
        raise ConfigError(f"--seeds {','.join(map(str, absent))} is invalid: no run of the group has it "
                          f"(its seeds: {', '.join(map(str, sorted(set(have)))) or 'none'})")
    return [spec for spec, seed in zip(specs, have) if seed in seeds]


def run_name(cfg: RunConfig, profile_steps: int) -> str:
    """model[-d<width>]-P<stages>-method[-<ratio>x][-proj-<kind>][-anchor-<kind>][-ar<anchor rank>][-sync-<mode>]
    [-scale-<mode>][-<steps>steps]-s<seed>:
    a variant or budget appears only where it differs from the method's default or the profile's steps."""
    c, default = cfg.compressor.resolved(), METHODS[cfg.compressor.method]
    parts = [cfg.model, *([f"d{cfg.model_overrides['d_model']}"] if "d_model" in cfg.model_overrides else []),
             f"P{cfg.stages}", c.method]
    if default["projector"]:
        parts.append(f"{c.ratio:g}x")
        if c.projector.kind != default["projector"]:
            parts.append(f"proj-{c.projector.kind}")
    if c.anchor.kind != default["anchor"]:
        parts.append(f"anchor-{c.anchor.kind}")
    if c.anchor.rank:                          # an explicit anchor rank (e.g. "uncompressed + anchors")
        parts.append(f"ar{c.anchor.rank}")
    if c.method == "mapl-rvq" and c.rvq.sync != RVQConfig().sync:
        parts.append(f"sync-{c.rvq.sync}")
    if c.method == "mapl-rvq" and c.rvq.scale != RVQConfig().scale:
        parts.append(f"scale-{c.rvq.scale}")
    if cfg.train.steps != profile_steps:
        parts.append(f"{cfg.train.steps}steps")
    return "-".join([*parts, f"s{cfg.train.seed}"])


def spec_config(profile: str, spec: dict, params: dict | None = None) -> RunConfig:
    """The RunConfig of one spec, named by ``name`` or :func:`run_name`."""
    params = params or load_params()
    over = dict(spec)
    name = over.pop("name", "")
    cfg = load_run_config(profile, over, params=params)
    return replace(cfg, run_name=name or run_name(cfg, load_run_config(profile, params=params).train.steps))


def check_names(profile: str, params: dict | None = None) -> None:
    """One name, one config, across every group of the profile (names are checkpoint file names)."""
    params = params or load_params()
    seen: dict[str, tuple[str, str]] = {}
    for group in group_names(profile, params):
        for spec in group_specs(profile, group, params):
            cfg = spec_config(profile, spec, params)
            h = config_hash(cfg)
            if seen.setdefault(cfg.name(), (h, group))[0] != h:
                raise ConfigError(f"run name {cfg.name()!r} is used for two different configs (groups "
                                  f"{seen[cfg.name()][1]!r} and {group!r}); give one of them a `name:`")
