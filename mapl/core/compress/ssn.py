"""Subspace Networks (SSN, Ramasinghe et al. 2025), the fixed-subspace baseline: every residual writer (``wo``,
``w2``, the embedding) of a sending stage is reparametrised as W = U Wk for one fixed orthonormal U, so with
pre-norm blocks and the static shift removed, Z = (X - shift) U is lossless. Reparametrised rather than projected
after each step (node0's ``ss_regularize``): the constraint holds at every moment and under any optimiser."""
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
    """Constrain the residual writers of ``layer_ids`` and the token embedding to span(U)."""
    model.tok_embeddings = SubspaceEmbedding(model.tok_embeddings.weight.data, U)
    for i in layer_ids:
        block = model.layers[str(i)]
        block.attn.wo = SubspaceLinear(block.attn.wo.weight.data, U)
        block.ffn.w2 = SubspaceLinear(block.ffn.w2.weight.data, U)
