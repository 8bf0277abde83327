"""Per-stage token anchors (the paper's factorized anchors): stage p adds a_p(t) to its input and subtracts
the same a_p before encoding, so the projector spends its rank on the rest and only token ids cross the wire.

kinds: "none"; "static" (SSN's fixed N(0, std) shift, shared by all stages); "full" (trainable V x d);
"factorized" (MAPL: trainable V x r_a times a fixed random orthonormal r_a x d basis).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..optim import stiefel_random

__all__ = ["Anchor"]


class Anchor(nn.Module):
    def __init__(self, kind: str, vocab_size: int, d_model: int, rank: int, *, seed: int,
                 static_std: float = 1.0, init_std: float = 0.0):
        super().__init__()
        self.kind = kind
        if kind == "none":
            pass
        elif kind == "static":
            if torch.empty(()).device.type == "meta":     # a meta model (plans, FLOPs): the shape, not a draw
                shift = torch.empty(vocab_size, d_model)
            else:
                g = torch.Generator().manual_seed(seed)
                shift = torch.randn(vocab_size, d_model, generator=g, device=g.device) * static_std
            self.register_buffer("shift", shift)
        elif kind == "full":
            self.table = nn.Parameter(torch.randn(vocab_size, d_model) * init_std)
        elif kind == "factorized":
            self.table = nn.Parameter(torch.randn(vocab_size, rank) * init_std)
            # fixed orthonormal rows (r_a x d), derived from the seed on every rank: never sent
            self.register_buffer("basis", stiefel_random(d_model, rank, seed).T.contiguous())
        else:
            raise ValueError(f"anchor={kind!r} is invalid: allowed 'none', 'static', 'full', 'factorized'")

    @property
    def needs_token_ids(self) -> bool:
        return self.kind != "none"

    def forward(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.kind == "none":
            return None
        if self.kind == "static":
            return self.shift[ids]
        if self.kind == "full":
            return self.table[ids]
        return self.table[ids] @ self.basis
