"""`mapl peer`: the peer systems' published cost on this artifact's link model (the code is mapl.planning.peer).
It takes no flags: the parser documents the command and refuses a stray flag instead of ignoring it."""
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
    """The command; a user error is one line, Ctrl-C or SIGTERM exit 130 (mapl.base.cli.run_cli)."""
    return run_cli(_main, argv, prog=PROG)
