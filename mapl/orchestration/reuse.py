"""Whether a run that was trained before can be reused instead of trained again.

:func:`decide` answers for one run, from three facts, in this order:

1. its results JSON is **current**: same config hash and steps, written by this training code
   (``provenance.code_fingerprint``, stamped by :func:`stamp_results`) -> ``"current"`` (nothing to do);
2. else another group of the same profile holds a current results JSON under the same run name (a run that
   two studies share, e.g. a 3,000-step baseline of group ``long`` that group ``decompose`` compares
   against) -> ``"copied"``: that file is copied here, since a results JSON records nothing of its group and
   the two runs would compute the same numbers. This is what makes such a group cheap on a fresh clone,
   where no checkpoint exists (they are git-ignored);
3. else its checkpoint was written for the same config by this training code (the ``<ckpt>.code``
   file beside it, written by :func:`mark_code` before training starts) -> ``"restore"`` when it is
   complete (a finished run: its results are rebuilt in seconds) or ``"resume"`` when it is not;
4. else ``"train"``: a checkpoint or results JSON left by another config or other code is deleted first.

"This training code" also covers code that ``reports/code-equivalence.json`` proves computes the same
numbers (:func:`same_code`; :mod:`mapl.orchestration.equivalence`): a refactor proven so retrains nothing.

"This training code" is :func:`mapl.core.fingerprint.code_fingerprint` over its ``TRAIN_SOURCES``, the files whose content
changes a run's numbers. dvc.yaml's train stage lists the same files as its deps
(``tests/test_notebooks.py`` holds the two lists equal), so DVC and this module agree on when the
training code changed. DVC clears a group's results folder before it reruns the stage; the
checkpoints under ``checkpoints/<profile>/`` then make a rerun after a params edit cheap, and the
fingerprint keeps them from surviving a code change. After a code change proven equivalent, ``refresh``
(:mod:`mapl.orchestration.refresh`) records the stages without that deletion.

    mapl reuse                               # the fingerprint of this checkout's training code, and its files
    mapl reuse adopt ../retrain cpu long     # take another checkout's finished runs (see adopt)
    mapl reuse adopt ../s0 ../s1 cpu blocks  # a group whose seeds finished in two checkouts
    mapl reuse compare ../retrain cpu long   # after `dvc repro -s train@long`: same numbers?
    mapl reuse prove ../retrain cpu          # other training code, the same numbers? (equivalence.py)
    mapl reuse refresh cpu [GROUP ...]       # after a proven change: record train stages (refresh.py)
    mapl reuse refresh cpu frozen_trunk      # the same for the frozen-trunk study's stage
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from ..base.io import read_json_object
from ..core.config import PROJECT_ROOT, RunConfig, config_hash, load_params
from ..core.fingerprint import code_fingerprint, source_files
from .currency import results_current, same_code
from .equivalence import COMPARED, differences
from .groups import group_lock, group_specs, hold_group_lock, results_dir, spec_config

# same_code and results_current (mapl.orchestration.currency) stay importable from here: the frozen-trunk study,
# whose text is part of its runs' currency, reads them as reuse.results_current
__all__ = ["ACTIONS", "DONE", "COMPARED", "current_twin", "same_code", "results_current", "checkpoint_files",
           "checkpoint_step", "decide", "runs_to_adopt", "mark_code", "stamp_results", "finished_in", "adopt",
           "compare_results", "compare_adopted", "main"]

ACTIONS = ("current", "copied", "restore", "resume", "train")
DONE = ("current", "copied")            # the actions after which the run has its results: nothing to run


def checkpoint_files(ckpt: Path) -> list[Path]:
    """The checkpoint of one run: ``<ckpt>`` (one process) or ``<stem>.rank<s>[.prev].pt`` (one per
    pipeline process)."""
    ckpt = Path(ckpt)
    return sorted({*([ckpt] if ckpt.exists() else []), *ckpt.parent.glob(f"{ckpt.stem}.rank*.pt")})


def _code_file(ckpt: Path) -> Path:
    return Path(ckpt).with_suffix(".code")


def checkpoint_step(ckpt: Path, cfg: RunConfig) -> int | None:
    """The step of the single-process checkpoint at ``ckpt`` if it is a loadable mapl checkpoint of
    this config, else None. (Pipeline checkpoints are checked by the pipeline when it resumes.)"""
    import torch

    from ..core.checkpoint import FORMAT
    try:
        ck = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception:               # noqa: BLE001 -- truncated, foreign or pickled: not reusable
        return None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT or ck.get("config_hash") != config_hash(cfg):
        return None
    step = (ck.get("state") or {}).get("step")
    return step if isinstance(step, int) else None


def current_twin(out: Path, cfg: RunConfig, fingerprint: str, root: Path = PROJECT_ROOT) -> Path | None:
    """A results JSON named like ``out`` in another group folder beside ``out``'s (``results/<group>/``) that
    is current for ``cfg`` and this training code (:func:`results_current`), or None; the first in group
    name order."""
    out = Path(out)
    groups = out.parent.parent
    if not groups.is_dir():
        return None
    for other in sorted(p for p in groups.iterdir() if p.is_dir() and p != out.parent):
        if results_current(other / out.name, cfg, fingerprint, root):
            return other / out.name
    return None


def _drop(paths, log, why: str) -> None:
    for p in paths:
        if p.exists():
            p.unlink()
            log(f"dropped {p.name}: {why}")


def decide(cfg: RunConfig, out: Path, ckpt: Path, fingerprint: str, log=lambda msg: None,
           root: Path = PROJECT_ROOT) -> tuple[str, int]:
    """(action, step the run starts from) for one run; see the module docstring. Deletes what cannot
    be reused (a results JSON or checkpoint of another config or other training code)."""
    out, ckpt = Path(out), Path(ckpt)
    if results_current(out, cfg, fingerprint, root):
        return "current", cfg.train.steps
    _drop([out], log, "not this config's or this code's result")
    twin = current_twin(out, cfg, fingerprint, root)
    if twin is not None:
        from ..base.io import atomic_write_text
        atomic_write_text(out, twin.read_text())
        log(f"{out.name}: copied from group {twin.parent.name} (same config and training code)")
        return "copied", cfg.train.steps
    files, code = checkpoint_files(ckpt), _code_file(ckpt)
    written_here = code.exists() and same_code(code.read_text().strip(), fingerprint, root)
    if files and not written_here:
        _drop([*files, code], log, "written by other training code")
        return "train", 0
    if ckpt in files:                                         # one process: we can tell how far it got
        step = checkpoint_step(ckpt, cfg)
        if step is None:
            _drop([ckpt, code], log, "not a loadable checkpoint of this config")
            return "train", 0
        return ("restore" if step >= cfg.train.steps else "resume"), step
    return ("resume", 0) if files else ("train", 0)


def mark_code(ckpt: Path, fingerprint: str) -> None:
    """Record which training code writes the checkpoint at ``ckpt`` (before its first save)."""
    path = _code_file(ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(fingerprint + "\n")


def stamp_results(out: Path, fingerprint: str) -> None:
    """Add ``provenance.code_fingerprint`` to a finished run's results JSON (same layout, atomic)."""
    from ..base.io import atomic_write_json
    res = read_json_object(out)
    if res is None:
        raise FileNotFoundError(f"{out}: no results JSON to stamp (the run did not write one)")
    res.setdefault("provenance", {})["code_fingerprint"] = fingerprint
    atomic_write_json(out, res)


# ---- adopting runs trained in other checkouts ----------------------------------------------------
# A long retrain runs in a second checkout (a git worktree on its own branch) while main moves on; a group's
# seeds may be split across machines, each checkout training some of its runs (`mapl sweep --group
# blocks --seeds 1`). The finished runs join main through DVC: their checkpoints are copied here (adopt, from
# every checkout that holds some of them), `dvc repro -s train@<group>` restores every run from them (decide
# -> "restore"), and the restored results are compared with the ones each checkout wrote (compare_results).
# Only checkpoints written by this training code are taken, so a run is never adopted from code that
# computes other numbers.


def finished_in(sources: Sequence[Path], profile: str, group: str, name: str) -> Path | None:
    """The first checkout of ``sources`` whose results folder of ``group`` holds run ``name``'s results JSON
    (the run finished there), or None."""
    return next((Path(src) for src in sources
                 if read_json_object(results_dir(profile, group, Path(src)) / f"{name}.json") is not None), None)


def _adoptable(src: Path, profile: str, name: str, fingerprint: str, dest_root: Path) -> list[Path]:
    """The checkpoint files of run ``name`` in checkout ``src`` (and its code stamp), if this training code (or
    code proven to compute the same numbers) wrote them; else ValueError naming the run."""
    src_ck = src / "checkpoints" / profile
    code = src_ck / f"{name}.code"
    stamp = code.read_text().strip() if code.exists() else None
    if not same_code(stamp, fingerprint, dest_root):
        raise ValueError(f"{name}: its checkpoint in {src} was written by training code {stamp or '(unknown)'}, "
                         f"not this checkout's {fingerprint}, and no proof that the two compute the same "
                         f"numbers (mapl reuse prove {src} {profile})")
    ckpts = checkpoint_files(src_ck / f"{name}.pt")
    if not ckpts:
        raise ValueError(f"{name}: no checkpoint in {src_ck}")
    import zipfile
    for ck in ckpts:        # torch's checkpoints are zip archives: a cut one has no central directory at its end
        if not zipfile.is_zipfile(ck):
            raise ValueError(f"{name}: {ck} is not a whole checkpoint (cut short by an interrupted copy or write?): "
                             f"copy it again, or rerun the run in {src}; nothing was adopted")
    return [*ckpts, code]


def adopt(sources: Sequence[Path], profile: str, names: Sequence[str], fingerprint: str,
          dest_root: Path = PROJECT_ROOT, group: str = "") -> list[Path]:
    """Copy the checkpoints of the finished runs ``names`` into this checkout's ``checkpoints/<profile>/``, each
    from the first checkout of ``sources`` where it finished (:func:`finished_in`; a group's runs may be spread
    over several, and ``dest_root`` itself may be one: its runs are checked and stay where they are). Every
    run must have finished in one of them, with a checkpoint stamped with ``fingerprint`` (this training
    code) or with training code that ``dest_root``'s ``reports/code-equivalence.json`` proves computes the
    same numbers (:func:`same_code`; the stamp is copied as it is: it names the code that wrote the
    checkpoint); otherwise nothing is copied and :class:`ValueError` names the first run that fails.
    Returns the files copied."""
    import shutil
    dest_root = Path(dest_root)
    dest_ck = dest_root / "checkpoints" / profile
    files = []
    for name in names:
        src = finished_in(sources, profile, group, name)
        if src is None:
            folders = " or ".join(str(results_dir(profile, group, Path(s))) for s in sources)
            raise ValueError(f"{name}: no results JSON in {folders}: the run has not finished there")
        found = _adoptable(src, profile, name, fingerprint, dest_root)
        if src.resolve() != dest_root.resolve():
            files += found
    dest_ck.mkdir(parents=True, exist_ok=True)
    for f in files:         # each file whole or not at all: an interrupted adoption leaves no cut checkpoint here
        tmp = dest_ck / f".{f.name}.adopting"
        try:
            shutil.copy2(f, tmp)
            os.replace(tmp, dest_ck / f.name)
        except BaseException:               # an interrupt or a full disk: no half copy left behind either
            tmp.unlink(missing_ok=True)
            raise
    return [dest_ck / f.name for f in files]


def runs_to_adopt(cfgs: Sequence[RunConfig], folder: Path, fingerprint: str, root: Path = PROJECT_ROOT) -> list[str]:
    """The runs of a group (``cfgs``, results in ``folder``) whose checkpoints must be adopted: all but
    those another group of this checkout holds current (:func:`current_twin`), which the stage copies."""
    return [c.name() for c in cfgs if current_twin(Path(folder) / f"{c.name()}.json", c, fingerprint, root) is None]


def compare_results(src_dir: Path, dest_dir: Path, names: Sequence[str]) -> list[str]:
    """Where the results JSON of ``names`` in ``dest_dir`` (restored here) differ from those in ``src_dir``
    (trained there) in any of :data:`COMPARED`: one line per difference (empty: the same numbers)."""
    out = []
    for name in names:
        a, b = read_json_object(Path(src_dir) / f"{name}.json"), read_json_object(Path(dest_dir) / f"{name}.json")
        if a is None or b is None:
            out.append(f"{name}: results missing in {src_dir if a is None else dest_dir}")
            continue
        out += [f"{name}: {key} differs" for key in differences(a, b)]
    return out


def compare_adopted(sources: Sequence[Path], profile: str, group: str, names: Sequence[str],
                    dest_root: Path = PROJECT_ROOT) -> list[str]:
    """:func:`compare_results` of each run against the checkout of ``sources`` where it finished."""
    here, out = results_dir(profile, group, dest_root), []
    for name in names:
        src = finished_in(sources, profile, group, name)
        out += (compare_results(results_dir(profile, group, src), here, [name]) if src is not None
                else [f"{name}: results missing in every checkout ({', '.join(map(str, sources))})"])
    return out


USAGE = ("usage: mapl reuse                                 (the training-code fingerprint and its files)\n"
         "       mapl reuse adopt CHECKOUT... PROFILE GROUP (copy GROUP's finished checkpoints from the "
         "checkouts, each run from the first where it finished)\n"
         "       mapl reuse compare CHECKOUT... PROFILE GROUP (restored results here vs the checkouts')\n"
         "       mapl reuse prove CHECKOUT PROFILE [STEPS]  (CHECKOUT's training code computes this one's "
         "numbers? recorded if so)\n"
         "       mapl reuse refresh PROFILE [GROUP ...]     (after a proven-equivalent code change: "
         "re-execute and `dvc commit` each train stage whose runs are all current, training nothing)")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(code_fingerprint())
        for path in source_files():
            print(f"  {path.relative_to(PROJECT_ROOT).as_posix()}")
        return 0
    if args[0] == "prove" and len(args) in (3, 4):
        return _prove(*args[1:])
    if args[0] == "refresh" and len(args) >= 2:
        return _refresh(args[1], args[2:])
    if len(args) < 4 or args[0] not in ("adopt", "compare"):
        print(USAGE, file=sys.stderr)
        return 2
    what, sources, profile, group = args[0], [Path(a) for a in args[1:-2]], args[-2], args[-1]
    try:
        _check_checkouts(sources)
        return (_adopt if what == "adopt" else _compare)(sources, profile, group)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_checkouts(sources: Sequence[Path]) -> None:
    """Each CHECKOUT argument is another mapl checkout (a folder with params.yaml and mapl/), not this one."""
    for src in sources:
        if not (src / "params.yaml").is_file() or not (src / "mapl").is_dir():
            raise ValueError(f"CHECKOUT {src} is not a mapl checkout (no params.yaml and mapl/ there): give the folder "
                             "of the other checkout (a git worktree of this repository)")
        if src.resolve() == PROJECT_ROOT.resolve():
            raise ValueError(f"CHECKOUT {src} is this checkout: give the other one, where the runs were trained")


def _group_configs(profile: str, group: str) -> list[RunConfig]:
    params = load_params()
    return [spec_config(profile, s, params).validate() for s in group_specs(profile, group, params)]


def _adopt(sources: list[Path], profile: str, group: str) -> int:
    cfgs, fingerprint = _group_configs(profile, group), code_fingerprint()
    taken = runs_to_adopt(cfgs, results_dir(profile, group), fingerprint)
    shared = len(cfgs) - len(taken)
    lock = hold_group_lock(group_lock(profile, group, PROJECT_ROOT), profile, group,
                           "an adoption beside it would copy checkpoints under a sweep or another adoption")
    try:
        copied = adopt(sources, profile, taken, fingerprint, group=group)
    finally:
        lock.release()
    where = ", ".join(f"{sum(finished_in(sources, profile, group, n) == src for n in taken)} from {src}" for src in sources)
    print(f"adopted {len(taken)} run(s) of {profile}/{group} ({where}; {len(copied)} files; {shared} more are another "
          f"group's here and are copied); now `dvc repro -s train@{group}` restores them, then "
          f"`mapl reuse compare {' '.join(map(str, sources))} {profile} {group}`")
    return 0


def _compare(sources: list[Path], profile: str, group: str) -> int:
    names = [c.name() for c in _group_configs(profile, group)]
    diffs = compare_adopted(sources, profile, group, names)
    print("\n".join(diffs) if diffs else
          f"{len(names)} run(s) of {profile}/{group}: the same numbers as in {', '.join(map(str, sources))}")
    return 1 if diffs else 0


def _prove(checkout: str, profile: str, steps: str = "6") -> int:
    from .equivalence import EQUIVALENCE_FILE, prove
    if not steps.isdigit() or int(steps) < 1:
        print(f"error: STEPS={steps!r} is invalid: must be an integer >= 1", file=sys.stderr)
        return 2
    try:
        _check_checkouts([Path(checkout)])
        rec = prove(Path(checkout), profile, int(steps))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"training code {rec['old']} computes what {rec['new']} computes on {len(rec['configurations'])} "
          f"configurations ({rec['seconds']:.0f} s): recorded in {EQUIVALENCE_FILE}")
    return 0


def _refresh(profile: str, groups: Sequence[str]) -> int:
    from .refresh import refresh
    try:
        done = refresh(profile, groups)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(done)} stage(s) of {profile} re-executed and committed, nothing trained")
    return 0
