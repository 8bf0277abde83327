"""``mapl memory``: the memory plan per pipeline stage.

The command only; the parser and the code are :mod:`mapl.core.memory`'s."""
from __future__ import annotations

from ..base.cli import run_cli

__all__ = ["main"]


def _main(argv=None) -> int:
    from ..core.memory import main as memory_main               # torch: the plan builds stages on the meta device
    return memory_main(argv)


def main(argv=None) -> int:
    """The command; a user error is one line, Ctrl-C or SIGTERM exit 130 (:func:`mapl.base.cli.run_cli`)."""
    return run_cli(_main, argv, prog="mapl memory")
