"""Record train stages whose runs are all current after a change of the training code proven not to change
any number (``mapl reuse prove``; ``reports/code-equivalence.json``), or an edit of a group in
params.yaml that leaves every run's config as it was (two groups merged into one, their results moved with them).

Such a change makes DVC see ``train@<group>`` stages as changed (their deps are the training sources, their
params the group's entry), and ``dvc repro`` deletes a stage's outputs before it runs the stage: every
committed run would train again, hours of work that would reproduce the same numbers. Instead, for each
group whose every run is current (:func:`mapl.orchestration.currency.results_current` accepts
proven-equivalent code), this runs the stage's own command from ``dvc.yaml`` on the results as committed
(the notebook re-executes and trains nothing) and then ``dvc commit -f train@<group>``. A group with any run
that is not current is refused before anything runs: that one needs ``dvc repro``. DVC has no option to keep
a stage's outputs for a single rerun (only ``persist``, which would also keep results of runs removed from a
group), hence this.

    mapl reuse refresh cpu                           # every group of the profile with results
    mapl reuse refresh cpu long decompose            # these groups only
    mapl reuse refresh cpu frozen_trunk              # the frozen-trunk study's stage (its runs and trunks current)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import yaml

from ..base.declared_groups import declaration
from ..base.io import check_writable
from ..core.config import PROJECT_ROOT, load_params
from ..core.fingerprint import code_fingerprint
from .currency import results_current
from .groups import group_names, group_specs, results_dir, spec_config

__all__ = ["stage_command", "not_current", "refresh", "FROZEN_STAGE", "frozen_not_current"]

FROZEN_STAGE = "frozen_trunk"


def stage_command(group: str, profile: str, root: Path = PROJECT_ROOT) -> str:
    """``train@<group>``'s command as dvc.yaml writes it, with ``${profile}`` and ``${key}`` (the group: the
    train stage loops over params.yaml's declared ``groups:``) filled in."""
    train = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["train"]
    names = declaration(load_params(root / "params.yaml")).names()
    if group not in names:
        raise ValueError(f"group {group!r} has no train stage in dvc.yaml: allowed {', '.join(names)}")
    return " ".join(train["do"]["cmd"].split()).replace("${profile}", profile).replace("${key}", group)


def not_current(profile: str, group: str, fingerprint: str, params: dict | None = None,
                root: Path = PROJECT_ROOT) -> list[str]:
    """The runs of ``group`` whose results JSON is not current (missing, another config, unproven code)."""
    params = params or load_params(root / "params.yaml")
    out = []
    for spec in group_specs(profile, group, params):
        cfg = spec_config(profile, spec, params).validate()
        if not results_current(results_dir(profile, group, root) / f"{cfg.name()}.json", cfg, fingerprint, root):
            out.append(cfg.name())
    return out


def refresh(profile: str, groups: Sequence[str] = (), root: Path = PROJECT_ROOT, log=print,
            run: Callable[[str], None] | None = None) -> list[str]:
    """Re-execute and ``dvc commit`` the train stage of each group (default: every group with a results folder);
    the groups done. Raises ValueError, before running anything, when a group has a run that is not current or
    ``profile`` is not the one dvc.yaml's stages run (params.yaml ``profile``)."""
    params = load_params(root / "params.yaml")
    if params.get("profile") != profile:
        raise ValueError(f"profile {profile!r}: dvc.yaml's stages run params.yaml's profile "
                         f"{params.get('profile')!r}; refresh that one")
    names = group_names(profile, params)
    frozen = FROZEN_STAGE in groups
    groups = [g for g in groups if g != FROZEN_STAGE]
    unknown = [g for g in groups if g not in names]
    if unknown:
        raise ValueError(f"group(s) {', '.join(unknown)} not in profile {profile}: allowed {', '.join(names)} "
                         f"or {FROZEN_STAGE}")
    groups = list(groups) or ([] if frozen else [g for g in names if results_dir(profile, g, root).is_dir()])
    fingerprint = code_fingerprint(root)
    stale = {g: not_current(profile, g, fingerprint, params, root) for g in groups}
    stale = {g: runs for g, runs in stale.items() if runs}
    if stale:
        g, runs = next(iter(stale.items()))
        more = f" (and {len(stale) - 1} more group(s))" if len(stale) > 1 else ""
        raise ValueError(f"group {g}: {len(runs)} run(s) not current under training code {fingerprint}, e.g. "
                         f"{runs[0]}{more}: `dvc repro -s train@{g}` trains them; nothing was run")
    if frozen:
        missing = frozen_not_current(profile, root)
        if missing:
            raise ValueError(f"{FROZEN_STAGE}: {missing[0]}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
                             f": `dvc repro -s {FROZEN_STAGE}` runs the study; nothing was run")
    # both writes, checked before the first notebook runs (a read-only checkout: one line, nothing half-done)
    for path in (root / "dvc.lock", root / "reports" / profile / "notebooks" / "refresh.ipynb"):
        check_writable(path)
    run = run or (lambda cmd: _run(cmd, root))
    for g in groups:
        log(f"train@{g}: every run current; executing its notebook, then `dvc commit -f train@{g}`")
        run(stage_command(g, profile, root))
        run(f"dvc commit -f train@{g}")
    if frozen:
        log(f"{FROZEN_STAGE}: every boundary run current and every trunk's checkpoint here; executing its notebook, "
            f"then `dvc commit -f {FROZEN_STAGE}`")
        stage = yaml.safe_load((root / "dvc.yaml").read_text())["stages"][FROZEN_STAGE]
        run(" ".join(stage["cmd"].split()).replace("${profile}", profile))
        run(f"dvc commit -f {FROZEN_STAGE}")
        groups = [*groups, FROZEN_STAGE]
    return groups


def _frozen_stamp(root: Path) -> str:
    """The frozen-trunk study's code stamp, as :func:`mapl.orchestration.frozen_trunk.study_fingerprint` computes it
    (the training code and that module's bytes); read here from the file, since importing the study would close an
    import circle through the reuse tools (a test holds the two equal)."""
    import hashlib
    own = hashlib.sha256((root / "mapl" / "orchestration" / "frozen_trunk.py").read_bytes()).hexdigest()[:16]
    return f"{code_fingerprint(root)}+{own}"


def frozen_not_current(profile: str, root: Path = PROJECT_ROOT) -> list[str]:
    """Why the frozen-trunk stage of ``profile`` cannot be recorded without training (empty: it can): a boundary
    run whose results were stamped by code not proven equivalent, or a trunk whose checkpoint is not here (the
    study would train it again before anything else)."""
    import json
    from .currency import same_code
    folder = root / "reports" / profile / "frozen-trunk"
    results = sorted(folder.glob("frozen-*.json")) + sorted(folder.glob("tune/frozen-*.json"))
    if not results:
        return [f"no boundary run in {folder.relative_to(root)}"]
    stamp, out, trunks = _frozen_stamp(root), [], set()
    for path in results:
        res = json.loads(path.read_text())
        if not same_code((res.get("provenance") or {}).get("code_fingerprint"), stamp, root):
            out.append(f"{path.relative_to(root)} was trained by code not proven equivalent to {stamp}")
        trunks.add((res.get("trunk") or {}).get("run"))
    out += [f"the checkpoint of trunk {t} is not here (checkpoints/{profile}/{t}.pt)" for t in sorted(trunks - {None})
            if not (root / "checkpoints" / profile / f"{t}.pt").exists()]
    return out


def _run(cmd: str, root: Path) -> None:
    # this interpreter's scripts folder first: papermill and dvc of the environment mapl runs in
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(cmd, shell=True, cwd=root, env=env)
    if done.returncode:
        raise RuntimeError(f"`{cmd}` exited {done.returncode} (its output is above)")
