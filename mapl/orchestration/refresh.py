"""Record train stages whose runs are all current after a change of the training code proven not to change
any number (``mapl reuse prove``; ``reports/code-equivalence.json``).

Such a change makes DVC see every ``train@<group>`` stage as changed (its deps are the training sources), and
``dvc repro`` deletes a stage's outputs before it runs the stage: every committed run would train again,
hours of work that the proof says would reproduce the same numbers. Instead, for each group whose every run
is current (:func:`mapl.orchestration.reuse.results_current` accepts proven-equivalent code), this runs the
stage's own command from ``dvc.yaml`` on the results as committed (the notebook re-executes and trains
nothing) and then ``dvc commit -f train@<group>``. A group with any run that is not current is refused
before anything runs: that one needs ``dvc repro``. DVC has no option to keep a stage's outputs for a
single rerun (only ``persist``, which would also keep results of runs removed from a group), hence this.

    mapl reuse refresh cpu                           # every group of the profile with results
    mapl reuse refresh cpu long decompose            # these groups only
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import yaml

from ..core.config import PROJECT_ROOT, load_params
from ..core.fingerprint import code_fingerprint
from . import reuse

__all__ = ["stage_command", "not_current", "refresh"]


def stage_command(group: str, profile: str, root: Path = PROJECT_ROOT) -> str:
    """``train@<group>``'s command as dvc.yaml writes it, with ``${profile}`` and ``${item}`` filled in."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    train = stages["train"]
    if group not in train["foreach"]:
        raise ValueError(f"group {group!r} has no train stage in dvc.yaml: allowed {', '.join(train['foreach'])}")
    return " ".join(train["do"]["cmd"].split()).replace("${profile}", profile).replace("${item}", group)


def not_current(profile: str, group: str, fingerprint: str, params: dict | None = None,
                root: Path = PROJECT_ROOT) -> list[str]:
    """The runs of ``group`` whose results JSON is not current (missing, another config, unproven code)."""
    from .sweep import group_specs, spec_config
    params = params or load_params(root / "params.yaml")
    out = []
    for spec in group_specs(profile, group, params):
        cfg = spec_config(profile, spec, params).validate()
        if not reuse.results_current(root / "reports" / profile / "results" / group / f"{cfg.name()}.json", cfg,
                                     fingerprint, root):
            out.append(cfg.name())
    return out


def refresh(profile: str, groups: Sequence[str] = (), root: Path = PROJECT_ROOT, log=print,
            run: Callable[[str], None] | None = None) -> list[str]:
    """Re-execute and ``dvc commit`` the train stage of each group (default: every group with a results folder);
    the groups done. Raises ValueError, before running anything, when a group has a run that is not current or
    ``profile`` is not the one dvc.yaml's stages run (params.yaml ``profile``)."""
    from .sweep import group_names
    params = load_params(root / "params.yaml")
    if params.get("profile") != profile:
        raise ValueError(f"profile {profile!r}: dvc.yaml's stages run params.yaml's profile "
                         f"{params.get('profile')!r}; refresh that one")
    names = group_names(profile, params)
    unknown = [g for g in groups if g not in names]
    if unknown:
        raise ValueError(f"group(s) {', '.join(unknown)} not in profile {profile}: allowed {', '.join(names)}")
    groups = list(groups) or [g for g in names if (root / "reports" / profile / "results" / g).is_dir()]
    fingerprint = code_fingerprint(root)
    stale = {g: not_current(profile, g, fingerprint, params, root) for g in groups}
    stale = {g: runs for g, runs in stale.items() if runs}
    if stale:
        g, runs = next(iter(stale.items()))
        more = f" (and {len(stale) - 1} more group(s))" if len(stale) > 1 else ""
        raise ValueError(f"group {g}: {len(runs)} run(s) not current under training code {fingerprint}, e.g. "
                         f"{runs[0]}{more}: `dvc repro -s train@{g}` trains them; nothing was run")
    run = run or (lambda cmd: _run(cmd, root))
    for g in groups:
        log(f"train@{g}: every run current; executing its notebook, then `dvc commit -f train@{g}`")
        run(stage_command(g, profile, root))
        run(f"dvc commit -f train@{g}")
    return groups


def _run(cmd: str, root: Path) -> None:
    # this interpreter's scripts folder first: papermill and dvc of the environment mapl runs in
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(cmd, shell=True, cwd=root, env=env)
    if done.returncode:
        raise RuntimeError(f"`{cmd}` exited {done.returncode} (its output is above)")
