"""``mapl workspace``: smoke, verify or repro a profile in a copy of the checkout.

The command only; the parser and the code are :mod:`mapl.orchestration.workspace`'s."""
from __future__ import annotations

__all__ = ["main"]


def main(argv=None) -> int:
    from ..orchestration.workspace import main as workspace_main
    return workspace_main(argv)
