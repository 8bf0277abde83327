"""A profile's runs: params.yaml's ``profiles.<p>.runs`` (``<name>: {group: <group>, <settings>}``), one DVC stage
each (dvc.yaml ``train@<run>``); results go to ``reports/<profile>/results/<group>/<name>.json``.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..base.declared_groups import declaration
from ..base.io import atomic_write_text
from ..core.config import (METHODS, PROJECT_ROOT, ConfigError, RunConfig, RVQConfig, config_hash, hashed_config,
                           load_params, load_run_config)

__all__ = ["BUDGETS", "results_dir", "results_path", "config_path", "config_record", "write_configs", "profile_runs",
           "group_names", "group_specs", "runs_of_seeds", "check_budgets", "check_runs", "run_name", "spec_config"]

BUDGETS = "budgets"                  # params.yaml's named budgets, merged into run specs by YAML (`<<: *name`)


def results_dir(profile: str, group: str, root: Path = PROJECT_ROOT) -> Path:
    """``reports/<profile>/results/<group>``: profiles never write into each other's folders."""
    return Path(root) / "reports" / profile / "results" / group


def results_path(profile: str, name: str, group: str, root: Path = PROJECT_ROOT) -> Path:
    """Where run ``name`` of ``group`` writes its results JSON (the output of DVC's ``train@<name>``)."""
    return results_dir(profile, group, root) / f"{name}.json"


def config_path(profile: str, name: str, root: Path = PROJECT_ROOT) -> Path:
    """``reports/<profile>/configs/<name>.json``: the run's resolved config, what its DVC stage depends on."""
    return Path(root) / "reports" / profile / "configs" / f"{name}.json"


def config_record(cfg: RunConfig, group: str) -> str:
    """The JSON text of a run's resolved config: every field that changes its numbers (what its DVC stage reads)."""
    record = {"run": cfg.name(), "group": group, "config_hash": config_hash(cfg), "config": hashed_config(cfg)}
    return json.dumps(record, indent=1, sort_keys=True, default=str) + "\n"


def write_configs(profile: str, params: dict, root: Path = PROJECT_ROOT) -> int:
    """Write :func:`config_record` of every run of ``profile`` (DVC's validate stage) and remove the configs of runs
    params.yaml no longer has (the folder persists: DVC does not clear it, so a refused params.yaml keeps it whole);
    returns how many."""
    runs = profile_runs(profile, params)
    records = {config_path(profile, name, root): config_record(spec_config(profile, {"name": name, **spec}, params)
                                                               .validate(), spec["group"]) for name, spec in runs.items()}
    folder = config_path(profile, "x", root).parent
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in records.items():
        atomic_write_text(path, text)
    for stale in set(folder.glob("*.json")) - set(records):
        stale.unlink()
    return len(runs)


def profile_runs(profile: str, params: dict | None = None) -> dict[str, dict]:
    """``profiles.<profile>.runs``: name -> spec (its ``group`` a declared one), in params.yaml's order."""
    params = params or load_params()
    if profile not in params["profiles"]:
        raise ConfigError(f"profile={profile!r} is invalid: allowed {sorted(params['profiles'])}")
    runs = (params["profiles"][profile] or {}).get("runs") or {}
    where = f"profiles.{profile}.runs"
    if not isinstance(runs, dict):
        raise ConfigError(f"{where} is invalid: a mapping of run name -> {{group: <group>, <settings>}}")
    declared = declaration(params).names()
    for name, spec in runs.items():
        if not isinstance(spec, dict) or spec.get("group") not in declared:
            got = spec.get("group") if isinstance(spec, dict) else spec
            raise ConfigError(f"{where}.{name}.group = {got!r} is invalid: allowed the groups params.yaml declares "
                              f"under `groups:` ({', '.join(declared)})")
        if "name" in spec:
            raise ConfigError(f"{where}.{name}.name is invalid: a run's name is its key")
    return runs


def group_names(profile: str, params: dict | None = None) -> list[str]:
    """The declared groups, in order (``profile`` is checked to exist)."""
    params = params or load_params()
    profile_runs(profile, params)
    return list(declaration(params).names())


def group_specs(profile: str, group: str, params: dict | None = None) -> list[dict]:
    """The specs of ``group``'s runs in ``profile`` (each with its ``name``), in params.yaml's order."""
    params = params or load_params()
    if group not in declaration(params).names():
        raise ConfigError(f"group={group!r} is invalid: allowed {list(declaration(params).names())}")
    return [{"name": name, **{k: v for k, v in spec.items() if k != "group"}}
            for name, spec in profile_runs(profile, params).items() if spec["group"] == group]


def runs_of_seeds(profile: str, specs: list[dict], seeds: list[int], params: dict | None = None) -> list[dict]:
    """The specs among ``specs`` whose run has one of ``seeds``; a seed that no run has is refused in one line."""
    params = params or load_params()
    have = [spec_config(profile, s, params).train.seed for s in specs]
    absent = [s for s in seeds if s not in have]
    if absent:
        raise ConfigError(f"--seeds {','.join(map(str, absent))} is invalid: no run of the group has it "
                          f"(its seeds: {', '.join(map(str, sorted(set(have)))) or 'none'})")
    return [spec for spec, seed in zip(specs, have) if seed in seeds]


def check_budgets(params: dict) -> None:
    """Each named budget is a non-empty mapping of run settings that resolves for the default profile."""
    budgets = params.get(BUDGETS) or {}
    if not isinstance(budgets, dict):
        raise ConfigError(f"{BUDGETS} = {budgets!r} is invalid: a mapping of name -> run settings "
                          "(e.g. steps_3000: &steps_3000 {train.steps: 3000})")
    for name, budget in budgets.items():
        if not isinstance(budget, dict) or not budget or {"name", "group"} & set(budget):
            raise ConfigError(f"{BUDGETS}.{name} = {budget!r} is invalid: a non-empty mapping of run settings "
                              "(no `name` or `group`: a budget is shared by many runs)")
        try:
            load_run_config(params["profile"], budget, params=params)
        except ConfigError as e:
            raise ConfigError(f"{BUDGETS}.{name} ({budget}): {e}") from None


def check_runs(profile: str, params: dict) -> int:
    """Every run of ``profile`` builds a valid config under a plain file name; returns how many."""
    runs = profile_runs(profile, params)
    for name, spec in runs.items():
        try:
            spec_config(profile, {"name": name, **spec}, params).validate()
        except ConfigError as e:
            raise ConfigError(f"profiles.{profile}.runs.{name}: {e}") from None
    return len(runs)


def run_name(cfg: RunConfig, profile_steps: int) -> str:
    """``model-P<stages>-method[-<ratio>x]...-s<seed>``: a variant or budget appears only where it is not the default."""
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
    if c.grad_wire != "same":
        parts.append(f"grad-{c.grad_wire}")
    if cfg.train.steps != profile_steps:
        parts.append(f"{cfg.train.steps}steps")
    return "-".join([*parts, f"s{cfg.train.seed}"])


def spec_config(profile: str, spec: dict, params: dict | None = None, from_string: bool = False) -> RunConfig:
    """The RunConfig of one spec (its ``group`` aside), named by ``name`` or :func:`run_name`."""
    params = params or load_params()
    over = {k: v for k, v in spec.items() if k != "group"}
    name = over.pop("name", "")
    cfg = load_run_config(profile, over, params=params, from_string=from_string)
    return replace(cfg, run_name=name or run_name(cfg, load_run_config(profile, params=params).train.steps))
