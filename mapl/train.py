"""Train one run in one process: every pipeline stage in order, every boundary through its wire.

    python -m mapl.train --profile cpu --method mapl --ratio 8 --out reports/results/mapl-8x.json

Rerunning the same command resumes from the checkpoint (``--ckpt``, default checkpoints/<run>.pt);
``--fresh`` starts over (the checkpoint; a results JSON of another config at ``--out`` is replaced only
with ``--replace-results``); ``--resume-with-changes`` continues a checkpoint with new learning rates,
step budget or evaluation settings (``mapl.config.RESUMABLE_FIELDS``; recorded in the results).
Ctrl-C/SIGTERM: the step in flight completes, the checkpoint is written, exit code 130.
Exit codes (``mapl.cli``): 0 done, 1 a bug (traceback), 2 invalid settings, files or output paths (one
line; ``--debug`` adds the traceback), 4 non-finite values (the last good checkpoint is kept), 130
interrupted.

The multi-process pipeline (one process per stage) is ``python -m mapl.pipeline``; both run the same
loop (mapl/loop.py). ``--help`` documents every flag; profiles live in params.yaml.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# No torch at import: the CLI parses and validates its flags and config (mapl.config needs no torch) before
# run() imports the engine, so a bad flag costs a start-up, not a torch import.
from .cli import add_debug_flag, run_cli
from .config import (EXECUTION_FIELDS, METHODS, PROJECT_ROOT, RESUMABLE_FIELDS, RunConfig, config_diff, config_hash,
                     load_params, load_run_config, parse_set)
from .io import OutputError, OutputLock, check_writable

__all__ = ["run", "main", "parse_args", "add_run_arguments", "config_from_args", "check_output_paths", "check_results_file"]

# Names this module used to re-export, kept importable (notebooks/data.ipynb imports resolve_data_dir from here)
# without importing torch with the CLI; code in the package imports them from the module named here.
_MOVED = {"build_optimizers": "engine", "resolve_data_dir": "engine", "lr_factor": "loop", "provenance": "results",
          "atomic_write_json": "io", "atomic_torch_save": "io"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(f".{_MOVED[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """A results JSON already at ``out`` is a finished run's numbers: a run of another config may not
    replace them unless ``replace`` (``--replace-results``). The same config may (the same numbers,
    as runs are deterministic), and so may a continuation with ``--resume-with-changes`` whose changes
    are all resumable (``mapl.config.RESUMABLE_FIELDS``). A file there that is no results JSON is
    refused too: nothing is overwritten silently."""
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
    """Train ``cfg`` in this process and return the results dict (also written to ``out``). Resumes
    from ``ckpt`` when it exists. ``on_step(step, steps, loss)`` is called after every optimizer step.
    Results of another config at ``out`` are refused unless ``replace_results`` (:func:`check_results_file`:
    after the checkpoint's own checks, whose messages say more about a resume)."""
    from .engine import LocalEngine          # torch: only once a run starts (see the imports above)
    from .loop import train
    started = time.time()
    check_output_paths(out, ckpt)
    with OutputLock(results=out, checkpoint=ckpt):        # a second run on the same paths is refused
        engine = LocalEngine.build(cfg, ckpt=ckpt)
        state = engine.resume(allow_changes=resume_with_changes, log=log)
        check_results_file(out, cfg, replace_results, resume_with_changes)
        if state is not None:
            log(f"resumed {ckpt} at step {state.step}" +
                (f" with changed settings {sorted(state.resumed_with_changes[-1]['changes'])}"
                 if state.resumed_with_changes and state.resumed_with_changes[-1]["step"] == state.step else ""))
        return train(engine, state, out=out, log=log, progress=progress, started=started, on_step=on_step)


# ---- CLI ------------------------------------------------------------------------------------------
def add_run_arguments(ap: argparse.ArgumentParser, params: dict) -> None:
    """The flags both CLIs (mapl.train, mapl.pipeline) share."""
    ap.add_argument("--profile", default=params.get("profile", "cpu"), choices=sorted(params.get("profiles", {})),
                    help="settings from params.yaml (default: %(default)s)")
    ap.add_argument("--model", help="model preset: micro, tiny, mini, 150M, 500M, 1B")
    ap.add_argument("--method", choices=sorted(METHODS), help="boundary compressor")
    ap.add_argument("--ratio", type=float, help="compression ratio d/r for projection methods (4, 8, 16, ...)")
    ap.add_argument("--projector", help="ablation: spel | fixed | unconstrained | fixed-shared")
    ap.add_argument("--anchor", help="ablation: none | static | full | factorized")
    ap.add_argument("--stages", type=int, help="pipeline stages P")
    ap.add_argument("--steps", type=int, help="optimizer steps")
    ap.add_argument("--seed", type=int, help="training seed (init and batch order)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other setting, e.g. --set train.lr_muon=0.03 --set compressor.rvq.rounds=4 (repeatable)")
    ap.add_argument("--out", type=Path, help="results JSON (default reports/results/<run>.json)")
    ap.add_argument("--ckpt", type=Path, help="checkpoint path (default checkpoints/<run>.pt); resumes if present")
    ap.add_argument("--fresh", action="store_true", help="ignore and overwrite an existing checkpoint")
    ap.add_argument("--resume-with-changes", action="store_true",
                    help="resume a checkpoint whose learning rates, step budget, warmup, clipping, weight decay, "
                         "evaluation settings or schedule differ from this run's (recorded in the results); any "
                         "other change is refused")
    ap.add_argument("--replace-results", action="store_true",
                    help="let this run replace a results JSON of another config at --out (refused otherwise)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    add_debug_flag(ap)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mapl.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap, load_params())
    return ap.parse_args(argv)


def config_from_args(args) -> RunConfig:
    """Flags and ``--set`` values, converted by each field's type (so errors name the field)."""
    over = {"model": args.model, "method": args.method, "ratio": args.ratio, "stages": args.stages,
            "projector": args.projector, "anchor": args.anchor, "train.steps": args.steps, "train.seed": args.seed}
    over = {k: (None if v is None else str(v)) for k, v in over.items()}
    over.update(parse_set(args.set))
    return load_run_config(args.profile, over, from_string=True)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    # every check that needs no data, before torch loads; the result is discarded, as run() validates
    # (and hashes) the config as given
    cfg.validate()
    out = args.out or PROJECT_ROOT / "reports" / "results" / f"{cfg.name()}.json"
    ckpt = args.ckpt or PROJECT_ROOT / "checkpoints" / f"{cfg.name()}.pt"
    check_output_paths(out, ckpt)
    if args.fresh:
        from .checkpoint import CheckpointSlot   # torch: after the config and paths are validated
        CheckpointSlot(ckpt).remove()
    res = run(cfg, out=out, ckpt=ckpt, progress=not args.no_progress, resume_with_changes=args.resume_with_changes,
              replace_results=args.replace_results)
    print(json.dumps({k: res[k] for k in ("run", "val_loss", "tokens", "tokens_per_s", "ratio")}))
    return 0


def main(argv=None) -> int:
    """The CLI; exit codes and one-line errors as ``mapl.cli`` documents (0, 2 user error, 4 non-finite,
    130 interrupted with the checkpoint written; ``--debug`` shows tracebacks)."""
    return run_cli(_main, argv, prog="python -m mapl.train")


if __name__ == "__main__":
    sys.exit(main())
