"""`mapl rescore`: score a group's finished runs on held-out windows (mapl.orchestration.rescore)."""
from __future__ import annotations

from ..base.cli import add_debug_flag, run_cli
from ..core.config import ConfigError, load_params
from ..orchestration import rescore
from ..orchestration.groups import group_names
from . import add_profile, command_parser

__all__ = ["main", "PROG"]

PROG = "mapl rescore"


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = command_parser("rescore", "Score a group's finished runs on held-out windows that no choice saw.", """
        mapl rescore --group long                      # every run of the group
        mapl rescore --group long --retrain-missing    # retrain lost checkpoints first""")
    add_profile(ap)
    ap.add_argument("--group", action="append", required=True, help="run group of the profile (repeatable)")
    ap.add_argument("--retrain-missing", action="store_true",
                    help="first retrain the runs whose checkpoint is gone")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    params = load_params()
    known = group_names(args.profile, params)
    for g in args.group:
        if g not in known:
            raise ConfigError(f"--group {g!r} is invalid: profile {args.profile} has groups {', '.join(known)}")
    for g in args.group:
        if args.retrain_missing:
            rescore.retrain_missing(args.profile, g, params)
        rescore.rescore_group(args.profile, g, params)
    return 0
