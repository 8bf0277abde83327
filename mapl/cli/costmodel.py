"""``mapl costmodel``: GPU-hour estimate of a profile's run groups.

The command only; the parser and the code are :mod:`mapl.planning.costmodel`'s. Errors are one line
(:func:`mapl.base.cli.run_cli`)."""
from __future__ import annotations

from ..base.cli import run_cli

__all__ = ["main", "PROG"]

PROG = "mapl costmodel"


def main(argv=None) -> int:
    from ..planning.costmodel import main as costmodel_main     # torch: after `mapl --help` and the dispatch
    return run_cli(costmodel_main, argv, prog=PROG)
