"""``mapl train``: one run in one process: every pipeline stage in order, every boundary through its wire.

    mapl train --profile cpu --method mapl --ratio 8 --out reports/results/mapl-8x.json

Rerunning the same command resumes from the checkpoint (``--ckpt``, default checkpoints/<run>.pt);
``--fresh`` starts over (the checkpoint; a results JSON of another config at ``--out`` is replaced only
with ``--replace-results``); ``--resume-with-changes`` continues a checkpoint with new learning rates,
step budget or evaluation settings (``mapl.core.config.RESUMABLE_FIELDS``; recorded in the results).
Ctrl-C/SIGTERM: the step in flight completes, the checkpoint is written, exit code 130.
Exit codes (``mapl.base.cli``): 0 done, 1 a bug (traceback), 2 invalid settings, files or output paths (one
line; ``--debug`` adds the traceback), 4 non-finite values (the last good checkpoint is kept), 130
interrupted.

The multi-process pipeline (one process per stage) is ``mapl pipeline``; both run the same
loop (mapl/core/loop.py). ``--help`` documents every flag; profiles live in params.yaml.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# No torch at import: the CLI parses and validates its flags and config (mapl.core.config needs no torch) before
# run() imports the engine, so a bad flag costs a start-up, not a torch import.
from ..base.cli import add_debug_flag, run_cli
from ..core.config import METHODS, PROJECT_ROOT, RunConfig, load_params, load_run_config, parse_set
from ..core.model_config import PRESETS
from ..core.run import check_output_paths, run

__all__ = ["main", "parse_args", "add_run_arguments", "config_from_args", "PROG"]

PROG = "mapl train"

# ---- CLI ------------------------------------------------------------------------------------------
def add_run_arguments(ap: argparse.ArgumentParser, params: dict) -> None:
    """The flags both commands (``mapl train``, ``mapl pipeline``) share."""
    ap.add_argument("--profile", default=params.get("profile", "cpu"), choices=sorted(params.get("profiles", {})),
                    help="settings from params.yaml (default: %(default)s)")
    ap.add_argument("--model", help="model preset: " + ", ".join(PRESETS))
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
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
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
        from ..core.checkpoint import CheckpointSlot   # torch: after the config and paths are validated
        CheckpointSlot(ckpt).remove()
    res = run(cfg, out=out, ckpt=ckpt, progress=not args.no_progress, resume_with_changes=args.resume_with_changes,
              replace_results=args.replace_results)
    print(json.dumps({k: res[k] for k in ("run", "val_loss", "tokens", "tokens_per_s", "ratio")}))
    return 0


def main(argv=None) -> int:
    """The CLI; exit codes and one-line errors as ``mapl.base.cli`` documents (0, 2 user error, 4 non-finite,
    130 interrupted with the checkpoint written; ``--debug`` shows tracebacks)."""
    return run_cli(_main, argv, prog=PROG)
