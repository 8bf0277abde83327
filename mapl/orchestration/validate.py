"""params.yaml as a whole, validated before DVC touches an output (dvc.yaml's first stage, ``validate``).

DVC removes a stage's outputs before its command runs, so one bad value would delete a group's committed
results and fail inside a notebook. ``mapl sweep --check --stamp reports/params-valid.txt`` runs
:func:`check_params` first; every other stage depends on the stamp it writes. The check reads every part
of the file that training reads: the group declaration, the named budgets, each profile's settings, launcher
and runs, the frozen-trunk studies, the scale ladder's budget rule and the groups to rescore; so this module sits
above the sweep and the frozen-trunk study, and nothing in orchestration imports it.
"""
from __future__ import annotations

from pathlib import Path

from ..base.declared_groups import declaration
from ..core.config import ConfigError, load_params, load_run_config
from .frozen_trunk import settings as frozen_trunk_settings
from .groups import check_budgets, check_names, group_names, group_runs, spec_config
from .ladder import check_ladder
from .rescore import declared_groups as rescored_groups
from .sweep import launcher_config

__all__ = ["STAMP_TEXT", "check_params", "write_stamp"]

# a DVC output every stage depends on: its text names the old spelling of `mapl sweep --check` because a new text
# would make DVC rerun every stage
STAMP_TEXT = ("params.yaml passed `python -m mapl.sweep --check` (DVC's validate stage; the same text every time, so "
              "that a params edit reruns only the stages whose params changed)\n")


def check_params(params: dict | None = None) -> str:
    """Every profile of params.yaml as training reads it: the declared groups, the named budgets, the profile's own
    settings, its launcher and every run of every group, validated (as far as can be without the data) and named uniquely;
    the top-level ``profile:`` must name one. Raises ``ConfigError`` (one line naming the key); returns a
    summary line."""
    params = params or load_params()
    profiles = params["profiles"]
    if params.get("profile") not in profiles:
        raise ConfigError(f"profile={params.get('profile')!r} (the top-level `profile:` of params.yaml) is invalid: "
                          f"allowed {sorted(profiles)}")
    declared = declaration(params)
    check_budgets(params)
    runs = 0
    for profile in profiles:
        load_run_config(profile, params=params).validate()
        launcher_config(profile, params)
        for group in group_names(profile, params):
            for where, spec in group_runs(profile, group, params):
                try:
                    spec_config(profile, spec, params).validate()
                except ConfigError as e:
                    raise ConfigError(f"{where} ({spec}): {e}") from None
                runs += 1
        check_names(profile, params)
        frozen_trunk_settings(profile, params)
        check_ladder(profile, params)
        rescored_groups(profile, params)
    return (f"params.yaml: {len(declared.names())} groups in {len(declared.studies())} studies, {len(profiles)} "
            f"profiles, {runs} runs in their groups, every setting valid")


def write_stamp(path: Path) -> None:
    from ..base.io import atomic_write_text
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, STAMP_TEXT)
