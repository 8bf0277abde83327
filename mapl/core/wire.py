"""The byte meter: per boundary and direction, the exact bytes of every payload ("data"), piggybacked shared
state ("sync"), token ids and per-step state; results report them beside the declared totals (tests: equal)."""
from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["ByteMeter", "id_dtype"]


def id_dtype(vocab_size: int) -> torch.dtype:
    """Token ids travel as 16-bit when the vocabulary fits (the uint16 bit pattern in an int16)."""
    return torch.int16 if vocab_size <= 65536 else torch.int32


class ByteMeter:
    def __init__(self):
        self.bytes = defaultdict(int)      # (boundary, direction, kind) -> bytes
        self.tokens = defaultdict(int)     # (boundary, direction) -> tokens carried

    def add(self, boundary: int, direction: str, kind: str, nbytes: int) -> None:
        self.bytes[(boundary, direction, kind)] += int(nbytes)

    def add_payload(self, boundary, direction, payload, roles, tokens):
        for t, role in zip(payload, roles, strict=True):
            self.add(boundary, direction, role, t.numel() * t.element_size())
        self.tokens[(boundary, direction)] += int(tokens)

    def total(self, kind: str | None = None, direction: str | None = None, boundary: int | None = None) -> int:
        return sum(v for (b, d, k), v in self.bytes.items()
                   if (kind is None or k == kind) and (direction is None or d == direction)
                   and (boundary is None or b == boundary))

    def state_dict(self) -> dict:
        return {"bytes": [[*k, v] for k, v in self.bytes.items()], "tokens": [[*k, v] for k, v in self.tokens.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.bytes = defaultdict(int, {(b, d, k): v for b, d, k, v in state["bytes"]})
        self.tokens = defaultdict(int, {(b, d): v for b, d, v in state["tokens"]})

    def summary(self) -> dict:
        out = {}
        for (b, d, k), v in sorted(self.bytes.items()):
            out.setdefault(f"boundary{b}", {}).setdefault(d, {})[k] = v
        return out
