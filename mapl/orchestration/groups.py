"""A profile's run groups: the run specs of each group, their configs and their names.

params.yaml declares every group once (top-level ``groups:``, :mod:`mapl.base.declared_groups`: study, role,
order); each profile lists every declared group under ``profiles.<p>.groups``, a list of run specs (an empty
list trains nothing). A spec is a dict of overrides for :func:`mapl.core.config.load_run_config` (``method``,
``ratio``, ``projector``, ``anchor``, ``train.seed``, ``model.d_model``, ...) plus an optional ``name``
(default: :func:`run_name`). A budget (steps, warm-up, evaluation cadence) is written once under
``budgets:`` and merged into a spec with YAML's merge key (``{<<: *steps_3000, method: none}``; the spec's
own keys win): the YAML parser resolves it, so this module, DVC's params (``profiles.<p>.groups.<group>``:
a budget's edit reruns exactly the groups that merge it) and ``mapl.data``'s grid all read plain specs.
A group's seeds may be split across machines: :func:`runs_of_seeds` keeps the runs of some seeds.

This is the bottom of the orchestration package: reuse, refresh, the sweep, the validator and the planning
layer read groups from here (the frozen-trunk study and notebooks/train.ipynb through the sweep, which
re-exports them), and it imports none of them.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..base.declared_groups import declaration
from ..base.io import OutputError, OutputLock
from ..core.config import METHODS, PROJECT_ROOT, ConfigError, RunConfig, RVQConfig, config_hash, load_params, load_run_config

__all__ = ["BUDGETS", "results_dir", "group_names", "group_entry", "located_runs", "group_runs", "group_specs",
           "runs_of_seeds", "check_budgets", "run_name", "spec_config", "check_names", "group_lock", "hold_group_lock"]

BUDGETS = "budgets"                  # params.yaml's named budgets, merged into run specs by YAML (`<<: *name`)

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
    """``profiles.<profile>.groups.<group>`` as written (a list of specs, or empty)."""
    groups = _profile_groups(profile, params or load_params())
    if group not in groups:
        raise ConfigError(f"group={group!r} is invalid for profile {profile!r}: allowed {sorted(groups)}")
    return groups[group]


def _spec(spec, where: str) -> dict:
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} = {spec!r} is invalid: a run spec is a mapping of settings (e.g. {{method: mapl, "
                          "ratio: 8}})")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ConfigError(f"{where}.name = {name!r} is invalid: must be a non-empty string")
    return dict(spec)


def located_runs(entry, where: str) -> list[tuple[str, dict]]:
    """(where the run is written, its spec) of every run of a group's entry (a list of specs; empty or None: none)."""
    if not entry:
        return []
    if not isinstance(entry, list):
        raise ConfigError(f"{where} = {entry!r} is invalid: a group is a list of run specs ([] trains none)")
    return [(f"{where}[{i}]", _spec(spec, f"{where}[{i}]")) for i, spec in enumerate(entry)]


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


def check_budgets(params: dict) -> None:
    """Each named budget is a non-empty mapping of run settings that resolves for the default profile (the runs
    that merge it are checked as runs too); one line naming the budget and the setting."""
    budgets = params.get(BUDGETS) or {}
    if not isinstance(budgets, dict):
        raise ConfigError(f"{BUDGETS} = {budgets!r} is invalid: a mapping of name -> run settings "
                          "(e.g. steps_3000: &steps_3000 {train.steps: 3000})")
    for name, budget in budgets.items():
        if not isinstance(budget, dict) or not budget or "name" in budget:
            raise ConfigError(f"{BUDGETS}.{name} = {budget!r} is invalid: a non-empty mapping of run settings "
                              "(no `name`: a budget is shared by many runs)")
        try:
            load_run_config(params["profile"], budget, params=params)
        except ConfigError as e:
            raise ConfigError(f"{BUDGETS}.{name} ({budget}): {e}") from None


def run_name(cfg: RunConfig, profile_steps: int) -> str:
    """model[-d<width>]-P<stages>-method[-<ratio>x][-proj-<kind>][-anchor-<kind>][-ar<anchor rank>][-sync-<mode>]
    [-scale-<mode>][-grad-<wire>][-<steps>steps]-s<seed>:
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
    if c.grad_wire != "same":
        parts.append(f"grad-{c.grad_wire}")
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
    """Names are data: no group lists one name twice, and one name means one config across every group of the
    profile (a name is a plain file name: :meth:`mapl.core.config.RunConfig.validate` refuses a path)."""
    params = params or load_params()
    seen: dict[str, tuple[str, str]] = {}
    for group in group_names(profile, params):
        in_group: set[str] = set()
        for spec in group_specs(profile, group, params):
            cfg = spec_config(profile, spec, params)
            name = cfg.name()             # a plain file name: RunConfig.validate refuses a path
            if name in in_group:
                raise ConfigError(f"profiles.{profile}.groups.{group}: run name {name!r} is listed twice; each run "
                                  "once per group")
            in_group.add(name)
            h = config_hash(cfg)
            if seen.setdefault(name, (h, group))[0] != h:
                raise ConfigError(f"run name {name!r} is used for two different configs (groups "
                                  f"{seen[name][1]!r} and {group!r}); give one of them a `name:`")


def group_lock(profile: str, group: str, root: Path = PROJECT_ROOT) -> Path:
    """The lock a sweep, or ``mapl reuse adopt``, holds on a group while it runs (beside the checkpoints,
    git-ignored, not in the folder DVC records)."""
    return Path(root) / "checkpoints" / profile / f"{group}.sweep"


def hold_group_lock(lock: Path, profile: str, group: str, why: str) -> OutputLock:
    """Hold ``lock`` (entered here, not in a ``with`` around the work: a run's own output lock refused inside it
    must keep its own message); held by another process, an OutputError naming it and ``why`` not to run beside
    it; a lock that cannot be written (a read-only checkout) keeps its own error."""
    try:
        return OutputLock(group=lock).__enter__()
    except OutputError as e:
        if e.holder is None:
            raise
        raise OutputError(f"group {group} of profile {profile} is in use by {e.holder}: wait for it to finish or stop "
                          f"it ({why})") from None
