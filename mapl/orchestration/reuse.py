"""Whether a run that was trained before can be reused instead of trained again.

:func:`decide` answers for one run, from three facts, in this order:

1. its results JSON is **current**: same config hash and steps, written by this training code
   (``provenance.code_fingerprint``, stamped by :func:`stamp_results`) -> ``"current"`` (nothing to do);
2. else its checkpoint was written for the same config by this training code (the ``<ckpt>.code``
   file beside it, written by :func:`mark_code` before training starts) -> ``"restore"`` when it is
   complete (a finished run: its results are rebuilt in seconds) or ``"resume"`` when it is not;
3. else ``"train"``: a checkpoint or results JSON left by another config or other code is deleted first.

"This training code" is :func:`mapl.core.fingerprint.code_fingerprint` over its ``TRAIN_SOURCES``, the files whose content
changes a run's numbers. dvc.yaml's train stage lists the same files as its deps
(``tests/test_notebooks.py`` holds the two lists equal), so DVC and this module agree on when the
training code changed. DVC clears a group's results folder before it reruns the stage; the
checkpoints under ``checkpoints/<profile>/`` then make a rerun after a params edit cheap, and the
fingerprint keeps them from surviving a code change.

    python -m mapl.reuse          # the fingerprint of this checkout's training code, and its files
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.config import PROJECT_ROOT, RunConfig, config_hash
from ..core.fingerprint import code_fingerprint, source_files

__all__ = ["ACTIONS", "results_current", "checkpoint_files",
           "checkpoint_step", "decide", "mark_code", "stamp_results", "main"]

ACTIONS = ("current", "restore", "resume", "train")


def _read_json(path: Path) -> dict | None:
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return res if isinstance(res, dict) else None


def results_current(out: Path, cfg: RunConfig, fingerprint: str) -> bool:
    """The results JSON at ``out`` is this config's, complete, and from this training code."""
    res = _read_json(out)
    if res is None:
        return False
    prov = res.get("provenance") or {}
    return (prov.get("config_hash") == config_hash(cfg) and res.get("steps") == cfg.train.steps
            and prov.get("code_fingerprint") == fingerprint)


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


def _drop(paths, log, why: str) -> None:
    for p in paths:
        if p.exists():
            p.unlink()
            log(f"dropped {p.name}: {why}")


def decide(cfg: RunConfig, out: Path, ckpt: Path, fingerprint: str, log=lambda msg: None) -> tuple[str, int]:
    """(action, step the run starts from) for one run; see the module docstring. Deletes what cannot
    be reused (a results JSON or checkpoint of another config or other training code)."""
    out, ckpt = Path(out), Path(ckpt)
    if results_current(out, cfg, fingerprint):
        return "current", cfg.train.steps
    _drop([out], log, "not this config's or this code's result")
    files, code = checkpoint_files(ckpt), _code_file(ckpt)
    same_code = code.exists() and code.read_text().strip() == fingerprint
    if files and not same_code:
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
    res = _read_json(out)
    if res is None:
        raise FileNotFoundError(f"{out}: no results JSON to stamp (the run did not write one)")
    res.setdefault("provenance", {})["code_fingerprint"] = fingerprint
    atomic_write_json(out, res)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python -m mapl.reuse   (prints the training-code fingerprint and its files)", file=sys.stderr)
        return 2
    print(code_fingerprint())
    for path in source_files():
        print(f"  {path.relative_to(PROJECT_ROOT).as_posix()}")
    return 0
