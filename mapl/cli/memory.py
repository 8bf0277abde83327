"""``mapl memory``: the memory plan per pipeline stage.

The command only; the parser and the code are :mod:`mapl.core.memory`'s."""
from __future__ import annotations

__all__ = ["main"]


def main(argv=None) -> int:
    from ..core.memory import main as memory_main               # torch: the plan builds stages on the meta device
    return memory_main(argv)
