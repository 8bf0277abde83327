"""``Doc``: one document of a corpus, its name and its text (a module of its own, below every source)."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Doc"]


class Doc(NamedTuple):
    name: str
    text: str
