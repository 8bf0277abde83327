"""`mapl plan`: each method's steps to target against uncompressed's (mapl.planning.planner)."""
from __future__ import annotations

from pathlib import Path

from ..base.cli import run_cli
from ..base.settings import check_quantity
from . import command_parser

__all__ = ["main", "PROG"]

PROG = "mapl plan"


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = command_parser("plan", "Print each method's steps to target against uncompressed, per training length.", """
        mapl plan                              # reports/cpu/results
        mapl plan reports/micro/results --target-pct 5""")
    ap.add_argument("results", nargs="?", default="reports/cpu/results", type=Path,
                    help="results folder (default: %(default)s)")
    ap.add_argument("--target-pct", type=float, default=2.0, metavar="PCT",
                    help="target: uncompressed's best loss + PCT %% (default 2)")
    a = ap.parse_args(argv)
    check_quantity("target_pct", a.target_pct, "--target-pct")     # nan gave "no run", a negative target nothing
    if not a.results.is_dir():
        what = "is not a folder" if a.results.exists() else "does not exist"
        raise ValueError(f"results folder {a.results} {what}: give the folder of a profile's results, "
                         "e.g. reports/cpu/results")
    from ..planning.planner import load_runs, main_model_runs, steps_report
    runs = main_model_runs(load_runs(a.results, variants=True))
    print(f"{len(runs)} runs of the main model in {a.results}\n")
    print(steps_report(runs, a.target_pct))
    return 0
