"""`mapl peer`: the peer systems' published cost on this artifact's link model (mapl.planning.peer)."""
from __future__ import annotations

from ..base.cli import run_cli
from . import command_parser

__all__ = ["main", "PROG"]

PROG = "mapl peer"


def _main(argv=None) -> int:
    command_parser("peer", "Put ProtocolNanoGPT's published conditions into this artifact's cost model.", """
        mapl peer             # writes reports/bench/peer-protocolnanogpt.json and reports/tables/peer.md
        mapl peer | tail -1   # the net speedups only""").parse_args(argv)
    from ..planning.peer import write_report
    print(write_report())
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)
