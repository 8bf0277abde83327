"""`mapl frozen-trunk`: the frozen-trunk study of a profile (mapl.orchestration.frozen_trunk)."""
from __future__ import annotations

from ..base.cli import add_debug_flag, run_cli
from ..core.config import ConfigError, load_params
from ..orchestration import frozen_trunk
from . import add_profile, command_parser

__all__ = ["main", "PROG"]

PROG = "mapl frozen-trunk"


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = command_parser("frozen-trunk", "Train boundaries into a frozen, trained model: the frozen-trunk study.", """
        mapl frozen-trunk                       # the default profile's study; resumes
        mapl frozen-trunk --profile micro --jobs 2""")
    add_profile(ap)
    ap.add_argument("--jobs", type=int, default=0, metavar="N",
                    help="runs side by side (0: the profile's launcher.jobs)")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if args.jobs < 0:                               # was: taken as "the profile's launcher", silently
        raise ConfigError(f"--jobs {args.jobs} is invalid: must be >= 0 (0: the profile's launcher.jobs)")
    frozen_trunk.run_study(args.profile, load_params(), jobs=args.jobs)
    return 0
