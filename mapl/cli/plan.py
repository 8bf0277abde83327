"""``mapl plan``: when compression pays: the steps-to-target ratio of every method against uncompressed.

The command only; the parser and the code are :mod:`mapl.planning.planner`'s. Errors are one line
(:func:`mapl.base.cli.run_cli`)."""
from __future__ import annotations

from ..base.cli import run_cli

__all__ = ["main", "PROG"]

PROG = "mapl plan"


def main(argv=None) -> int:
    from ..planning.planner import main as planner_main
    return run_cli(planner_main, argv, prog=PROG)
