"""``mapl peer``: the peer systems' published cost on this artifact's link model.

The command only; the code is :mod:`mapl.planning.peer`. It takes no flags: the parser is here so that
``--help`` documents the command instead of running it, and a stray flag is refused instead of ignored."""
from __future__ import annotations

import argparse

from ..base.cli import run_cli

__all__ = ["main", "PROG"]

PROG = "mapl peer"


def _main(argv=None) -> int:
    argparse.ArgumentParser(prog=PROG, description="ProtocolNanoGPT's conditions put into our cost model: writes "
                            "reports/bench/peer-protocolnanogpt.json and reports/tables/peer.md and prints the "
                            "table.").parse_args(argv)
    from ..planning.peer import main as peer_main
    return peer_main([])


def main(argv=None) -> int:
    """The command; a user error is one line, Ctrl-C or SIGTERM exit 130 (:func:`mapl.base.cli.run_cli`)."""
    return run_cli(_main, argv, prog=PROG)
