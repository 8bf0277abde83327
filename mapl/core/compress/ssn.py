"""Subspace Networks (SSN, Ramasinghe et al. 2025): the fixed-subspace baseline, made faithful.

Every projection that writes into the residual stream (attention output ``wo``, MLP down ``w2``, the
token embedding) is constrained to span(U) for one fixed seeded orthonormal U (d x k) shared by all
boundaries; a fixed N(0, 1) token shift (the static anchor) is added at the embedding and removed
before sending. With pre-norm blocks the boundary activation minus the shift then lies in span(U)
exactly, so Z = (X - shift) U is lossless.

We reparametrise (ProtocolNanoGPT's ``SubspaceLinear``: W = U Wk, Wk trainable, k x in) rather than
project after each step (node0's ``ss_regularize``): the constraint then holds by construction at every
moment (also mid-step and under any optimiser), Muon sees the k x in matrix it actually updates, and
nothing needs re-projecting. The layers of the last stage write to nothing that is sent and stay free.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SubspaceLinear", "SubspaceEmbedding", "constrain_to_subspace"]


class SubspaceLinear(nn.Module):
    """y = (x Wkᵀ) Uᵀ: output always in span(U)."""

    def __init__(self, weight: torch.Tensor, U: torch.Tensor):
        super().__init__()
        self.register_buffer("U", U.clone(), persistent=True)
        self.weight = nn.Parameter(U.T @ weight)           # (k, in): the projection of the dense init

    def forward(self, x):
        return F.linear(F.linear(x, self.weight), self.U.to(x.dtype))


class SubspaceEmbedding(nn.Module):
    """Embedding rows in span(U): table (V x k) times Uᵀ."""

    def __init__(self, weight: torch.Tensor, U: torch.Tensor):
        super().__init__()
        self.register_buffer("U", U.clone(), persistent=True)
        self.weight = nn.Parameter(weight @ U)             # (V, k)

    def forward(self, ids):
        return F.embedding(ids, self.weight) @ self.U.T


@torch.no_grad()
def constrain_to_subspace(model: nn.Module, U: torch.Tensor, layer_ids: list[int]) -> None:
    """Replace the residual writers of ``layer_ids`` (and the token embedding) by subspace versions."""
    model.tok_embeddings = SubspaceEmbedding(model.tok_embeddings.weight.data, U)
    for i in layer_ids:
        block = model.layers[str(i)]
        block.attn.wo = SubspaceLinear(block.attn.wo.weight.data, U)
        block.ffn.w2 = SubspaceLinear(block.ffn.w2.weight.data, U)
