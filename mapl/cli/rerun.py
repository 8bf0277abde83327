"""``mapl rerun``: train k seeds of a committed group again and judge them against the committed seeds
(mapl.orchestration.rerun; the rule: docs/protocol.md, "A reviewer's rerun")."""
from __future__ import annotations

import math
from pathlib import Path

from ..base.cli import EXIT_NOT_CONSISTENT, add_debug_flag, run_cli
from ..core.config import PROJECT_ROOT, ConfigError, load_params
from ..orchestration import rerun
from ..orchestration.groups import group_names
from . import add_profile, command_parser
from .sweep import seed_list

__all__ = ["main", "PROG"]

PROG = "mapl rerun"


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = command_parser("rerun", "Train k seeds of a committed group again and judge them against the committed "
                                 "seeds.", """
        mapl rerun --group long --seeds 0,1       # resumes; exit 6 if not consistent
        mapl rerun --profile micro --group main --seeds 0 --tolerance 1""")
    add_profile(ap)
    ap.add_argument("--group", required=True, help="a group of the profile with its uncompressed runs")
    ap.add_argument("--seeds", type=seed_list, required=True, help="its runs of these seeds, e.g. 0 or 0,1")
    ap.add_argument("--results", type=Path, help="committed results (default: reports/<profile>/results)")
    ap.add_argument("--out", type=Path, help="the reruns (default: reports/scratch/rerun/<profile>/<group>)")
    ap.add_argument("--tolerance", type=float, metavar="POINTS",
                    help="points of Δ%% and of a gap (default: measured by the profile's redraw groups)")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    params = load_params()
    known = group_names(args.profile, params)
    if args.group not in known:
        raise ConfigError(f"--group {args.group!r} is invalid: profile {args.profile} has groups {', '.join(known)}")
    results = args.results or PROJECT_ROOT / "reports" / args.profile / "results"
    if not results.is_dir():
        raise ConfigError(f"--results {results} is invalid: no such folder (the committed results of a profile)")
    tol = _tolerance(args, results, params)
    committed, ours = rerun.rerun_group(args.profile, args.group, args.seeds, results,
                                        args.out or rerun.rerun_dir(args.profile, args.group), params)
    checks = rerun.judge(committed, ours, tol)
    print(rerun.format_judgement(checks, rerun.same_run_differences(committed, ours), tol), flush=True)
    return 0 if all(c.consistent for c in checks) else EXIT_NOT_CONSISTENT


def _tolerance(args, results: Path, params: dict) -> rerun.Tolerance:
    """``--tolerance``, else the spread the profile's committed redraws measure; refused before any training."""
    if args.tolerance is not None:
        if not (math.isfinite(args.tolerance) and args.tolerance >= 0):     # inf would pass any rerun
            raise ConfigError(f"--tolerance {args.tolerance} is invalid: points of Δ%, finite and >= 0")
        return rerun.Tolerance(args.tolerance, args.tolerance, "given by --tolerance")
    measured = rerun.profile_tolerance(args.profile, results, params)
    if measured is None:
        raise ConfigError(f"--tolerance is required: {results} has no results of a redraw group of profile "
                          f"{args.profile} to measure the cross-machine spread from")
    return measured
