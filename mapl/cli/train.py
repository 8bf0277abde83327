"""``mapl train``: one run in one process, every stage in order, every boundary through its wire."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# No torch at import: the CLI parses and validates its flags and config (mapl.core.config needs no torch) before
# run() imports the engine, so a bad flag costs a start-up, not a torch import.
from ..base.cli import add_debug_flag, run_cli
from ..core.config import METHODS, PROJECT_ROOT, ConfigError, RunConfig, load_params, load_run_config, parse_set
from ..core.model_config import PRESETS
from ..core.run import check_output_paths
from . import add_profile, command_parser

__all__ = ["main", "parse_args", "add_run_arguments", "config_from_args", "PROG"]

PROG = "mapl train"
EXAMPLES = """
    mapl train --profile cpu --method mapl --ratio 8       # results in reports/results/<run>.json
    mapl train --method ssn --set train.lr_muon=0.04 --steps 300
    mapl train --name tiny-P4-mapl-8x-s1 --group seeds --method mapl --ratio 8 --train.seed 1   # as DVC runs it"""


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags both commands (``mapl train``, ``mapl pipeline``) share."""
    add_profile(ap, help="settings from params.yaml")
    ap.add_argument("--model", choices=list(PRESETS), metavar="PRESET", help="model preset (tiny, mini, 150M, ...)")
    ap.add_argument("--method", choices=sorted(METHODS), help="boundary compressor")
    ap.add_argument("--ratio", type=float, help="projection ratio d/r (4, 8, 16, ...)")
    ap.add_argument("--projector", help="ablation: spel, fixed, unconstrained, fixed-shared")
    ap.add_argument("--anchor", help="ablation: none, static, full, factorized")
    ap.add_argument("--stages", type=int, help="pipeline stages P")
    ap.add_argument("--steps", type=int, help="optimizer steps")
    ap.add_argument("--seed", type=int, help="training seed (init and batch order)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any setting, e.g. train.lr_muon=0.03 (repeatable)")
    ap.add_argument("--out", type=Path, help="results JSON (default reports/results/<run>.json)")
    ap.add_argument("--ckpt", type=Path, help="checkpoint, resumed if present")
    ap.add_argument("--fresh", action="store_true", help="start over: delete the checkpoint first")
    ap.add_argument("--resume-with-changes", action="store_true",
                    help="resume with other learning rates or budget")
    ap.add_argument("--replace-results", action="store_true", help="replace another config's results at --out")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines")
    add_debug_flag(ap)


def parse_args(argv=None):
    """The flags, and any ``--SECTION.KEY VALUE`` pairs (how ``dvc.yaml`` writes a run's settings) as ``--set``."""
    ap = command_parser("train", "Train one run in this process; rerun the command to resume from its checkpoint.",
                        EXAMPLES)
    add_run_arguments(ap)
    ap.add_argument("--name", help="the run's name (default: from its settings)")
    ap.add_argument("--group", help="a params.yaml run: results in its group's folder")
    args, rest = ap.parse_known_args(argv)
    args.set = [*args.set, *_settings_pairs(rest, ap)]
    return args


def _settings_pairs(rest: list[str], ap: argparse.ArgumentParser) -> list[str]:
    """``["--train.seed", "1", "--train.flag"]`` -> ``["train.seed=1", "train.flag=true"]`` (a dotted key with no value
    is a true boolean, as DVC writes one); anything else is argparse's one-line usage error."""
    out, i = [], 0
    while i < len(rest):
        key = rest[i]
        if not (key.startswith("--") and "." in key):
            ap.error(f"unrecognized arguments: {key}")
        has_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
        out.append(f"{key[2:]}={rest[i + 1] if has_value else 'true'}")
        i += 2 if has_value else 1
    return out


def config_from_args(args) -> RunConfig:
    """Flags and ``--set`` values, converted by each field's type (so errors name the field)."""
    over = {"model": args.model, "method": args.method, "ratio": args.ratio, "stages": args.stages,
            "projector": args.projector, "anchor": args.anchor, "train.steps": args.steps, "train.seed": args.seed,
            "run_name": getattr(args, "name", None)}
    over = {k: (None if v is None else str(v)) for k, v in over.items()}
    over.update(parse_set(args.set))
    return load_run_config(args.profile, over, from_string=True)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args).validate()          # every check that needs no data, before torch loads
    if args.group:
        from ..base.declared_groups import declaration
        from ..base.io import read_json_object
        from ..core.config import config_hash
        from ..orchestration.groups import config_path, results_path
        from ..orchestration.sweep import checkpoint_path
        declared = declaration(load_params()).names()
        if args.group not in declared:
            raise ConfigError(f"--group {args.group!r} is invalid: allowed the groups params.yaml declares "
                              f"({', '.join(declared)})")
        # a run of params.yaml builds the config its DVC stage depends on (written by the validate stage)
        path = config_path(args.profile, cfg.name())
        recorded = read_json_object(path) if path.is_file() else None
        if recorded and (recorded.get("config_hash"), recorded.get("group")) != (config_hash(cfg), args.group):
            raise ConfigError(f"these flags build another config than {path.relative_to(PROJECT_ROOT)} (params.yaml's "
                              f"run {cfg.name()}): run it with `dvc repro train@{cfg.name()}`, or drop --group")
        out = args.out or results_path(args.profile, cfg.name(), args.group)
        ckpt = args.ckpt or checkpoint_path(args.profile, cfg.name())
    else:
        out = args.out or PROJECT_ROOT / "reports" / "results" / f"{cfg.name()}.json"
        ckpt = args.ckpt or PROJECT_ROOT / "checkpoints" / f"{cfg.name()}.pt"
    check_output_paths(out, ckpt)
    if args.fresh:
        from ..core.checkpoint import CheckpointSlot   # torch: after the config and paths are validated
        CheckpointSlot(ckpt).remove()
    from ..orchestration.sweep import train_one
    spec = {**parse_set(args.set), **{k: v for k, v in vars(args).items()
                                      if k in ("model", "method", "ratio", "stages", "projector", "anchor") and v}}
    res = train_one(args.profile, cfg, spec, out, ckpt, every_s=0 if args.no_progress else 5.0,
                    by_launcher=bool(args.group), resume_with_changes=args.resume_with_changes,
                    replace_results=args.replace_results)
    if res is not None:
        print(json.dumps({k: res[k] for k in ("run", "val_loss", "tokens", "tokens_per_s", "ratio")}))
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)
