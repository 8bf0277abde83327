"""One run in this process (``mapl train``, the sweep's workers): the checks on its output paths, then the loop."""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..base.io import OutputError, OutputLock, check_writable
from .config import EXECUTION_FIELDS, RESUMABLE_FIELDS, RunConfig, config_diff, config_hash

__all__ = ["run", "check_output_paths", "check_results_file"]


def check_output_paths(out: Path | None, ckpt: Path | None, ckpt_files: list[Path] | None = None) -> None:
    """Before any work: the results and checkpoint paths differ and both can be written."""
    files = [Path(p) for p in (ckpt_files if ckpt_files is not None else [ckpt] if ckpt else [])]
    if out is not None and any(Path(out).resolve() == f.resolve() for f in files):
        raise OutputError(f"--out {out} is also the checkpoint path: the results would overwrite the checkpoint; "
                          "give them different paths, e.g. --out r.json --ckpt r.pt")
    for path in [out, *files]:
        if path is not None:
            check_writable(path)


def check_results_file(out: Path | None, cfg: RunConfig, replace: bool = False,
                       resume_with_changes: bool = False) -> None:
    """Refuse to replace a finished run's results JSON at ``out`` by another config's (unless ``replace``): the same
    config may, and so may a ``--resume-with-changes`` of resumable fields only; nothing else is overwritten."""
    if out is None or replace or not Path(out).is_file():
        return
    try:
        res = json.loads(Path(out).read_text())
        old = res["config"] if isinstance(res["config"], dict) else None
        old_hash = res["provenance"]["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        old = old_hash = None
    fix = "choose another --out, or pass --replace-results to replace it"
    if old is None:
        raise OutputError(f"--out {out} exists and is not a mapl results JSON: this run would replace it; {fix}")
    cfg = cfg.validate()
    if old_hash == config_hash(cfg):
        return
    as_json = json.loads(json.dumps(cfg.to_dict(), default=str))      # tuples read back from JSON as lists
    changes = {k: v for k, v in config_diff(old, as_json).items() if k not in EXECUTION_FIELDS}
    if resume_with_changes and set(changes) <= RESUMABLE_FIELDS:
        return
    named = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in list(changes.items())[:6]) + \
        (f", and {len(changes) - 6} more" if len(changes) > 6 else "")
    raise OutputError(f"--out {out} holds the results of another config ({named or 'another config hash'}): this run "
                      f"would replace a finished run's numbers; {fix}")


def run(cfg: RunConfig, out: Path | None = None, ckpt: Path | None = None, progress: bool = True, log=print,
        resume_with_changes: bool = False, on_step=None, replace_results: bool = False) -> dict:
    """Train ``cfg`` here, resuming from ``ckpt`` if it exists; the results dict, also written to ``out``.
    ``on_step(step, steps, loss)`` after every optimizer step."""
    from .engine import LocalEngine          # torch only once a run starts: the CLI validates first
    from .loop import train
    started = time.time()
    check_output_paths(out, ckpt)
    with OutputLock(results=out, checkpoint=ckpt):        # a second run on the same paths is refused
        engine = LocalEngine.build(cfg, ckpt=ckpt)
        state = engine.resume(allow_changes=resume_with_changes, log=log)
        check_results_file(out, cfg, replace_results, resume_with_changes)   # after the checkpoint's own checks
        if state is not None:
            log(f"resumed {ckpt} at step {state.step}" +
                (f" with changed settings {sorted(state.resumed_with_changes[-1]['changes'])}"
                 if state.resumed_with_changes and state.resumed_with_changes[-1]["step"] == state.step else ""))
        return train(engine, state, out=out, log=log, progress=progress, started=started, on_step=on_step)
