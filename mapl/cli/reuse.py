"""``mapl reuse``: the training-code fingerprint and its files; adopt, compare, prove or refresh finished runs.

The command only; the code, and the usage ``--help`` prints, are :mod:`mapl.orchestration.reuse`'s."""
from __future__ import annotations

import sys

from ..base.cli import run_cli

__all__ = ["main"]


def _main(argv=None) -> int:
    from ..orchestration import reuse
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):            # reuse reads its arguments by position: it has no --help
        print(reuse.USAGE)
        return 0
    return reuse.main(argv)


def main(argv=None) -> int:
    """The command; a user error is one line, Ctrl-C or SIGTERM exit 130 (:func:`mapl.base.cli.run_cli`)."""
    return run_cli(_main, argv, prog="mapl reuse")
