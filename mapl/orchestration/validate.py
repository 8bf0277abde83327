"""params.yaml as a whole, validated before DVC touches an output (dvc.yaml's first stage, ``validate``)."""
from __future__ import annotations

from pathlib import Path

from ..base.declared_groups import declaration
from ..core.config import ConfigError, load_params, load_run_config
from .frozen_trunk import settings as frozen_trunk_settings
from .groups import check_budgets, check_runs
from .ladder import check_ladder
from .rescore import declared_groups as rescored_groups
from .sweep import launcher_config

__all__ = ["STAMP_TEXT", "check_params", "write_stamp"]

# the same text every time, so that a params edit reruns only the stages whose params changed
STAMP_TEXT = "params.yaml passed `mapl sweep --check` (DVC's validate stage)\n"


def check_params(params: dict | None = None) -> str:
    """Every part of params.yaml that training reads; raises a one-line ``ConfigError``, else returns a summary."""
    params = params or load_params()
    profiles = params["profiles"]
    profile = params.get("profile")
    if profile not in profiles:
        raise ConfigError(f"profile={profile!r} (the top-level `profile:` of params.yaml) is invalid: "
                          f"allowed {sorted(profiles)}")
    if params.get("runs") != (profiles[profile] or {}).get("runs"):
        raise ConfigError(f"runs (the top-level `runs:` of params.yaml, what DVC trains) is invalid: it must be the "
                          f"profile's runs: `runs: *runs_{profile}`")
    declared = declaration(params)
    check_budgets(params)
    runs = 0
    for name in profiles:
        load_run_config(name, params=params).validate()
        launcher_config(name, params)
        runs += check_runs(name, params)
        frozen_trunk_settings(name, params)
        check_ladder(name, params)
        rescored_groups(name, params)
    return (f"params.yaml: {len(declared.names())} groups in {len(declared.studies())} studies, {len(profiles)} "
            f"profiles, {runs} runs, every setting valid")


def write_stamp(path: Path) -> None:
    from ..base.io import atomic_write_text
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, STAMP_TEXT)
