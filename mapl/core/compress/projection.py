"""Orthonormal projection to r dimensions, Z = X A: MAPL (learned A on the Stiefel manifold), SSN (one fixed
shared U) and the projector ablations. AᵀA = I makes Aᵀ the exact left inverse on col(A)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..optim import ortho_error
from .base import Compressor, StiefelParameter

__all__ = ["ProjectionCompressor"]


class _ReceiverSide(torch.autograd.Function):
    """A as the receiver's copy sees it. Backward keeps the receiver-side term apart (``comp._rx_grad``),
    folded in once per step as the multi-process runtime must: both add the same floats in the same order."""

    @staticmethod
    def forward(ctx, A, comp):
        ctx.comp = comp
        return A.view_as(A)

    @staticmethod
    def backward(ctx, g):
        c = ctx.comp
        c._rx_grad = g.clone() if c._rx_grad is None else c._rx_grad.add_(g)
        return None, None


class ProjectionCompressor(Compressor):
    """``projector``: "spel" (learned, optimised by SPEL), "unconstrained" (learned, plain optimiser),
    "fixed" (random orthonormal per boundary), "fixed-shared" (SSN's one U)."""

    def __init__(self, d_model: int, basis: torch.Tensor, projector: str, receiver_grad: str = "exact",
                 method: str = "mapl"):
        super().__init__(d_model)
        if basis.shape[0] != d_model or basis.shape[1] > d_model:
            raise ValueError(f"projector basis shape {tuple(basis.shape)} is invalid: need (d_model={d_model}, r<=d)")
        self.method = method
        self.projector = projector
        self.receiver_grad = receiver_grad
        self.learned = projector in ("spel", "unconstrained")
        self._rx_grad = None
        if projector == "spel":
            self.A = StiefelParameter(basis.clone())
        elif projector == "unconstrained":
            self.A = nn.Parameter(basis.clone())
        else:
            self.register_buffer("A", basis.clone())

    @property
    def code_dim(self) -> int:
        return self.A.shape[1]

    def encode(self, x):
        return x @ self.A.to(x.dtype)

    def decode(self, z):
        if not self.learned:
            A = self.A
        elif self.receiver_grad == "exact":
            A = _ReceiverSide.apply(self.A, self)
        else:
            A = self.A.detach()
        return z @ A.to(z.dtype).T

    def basis(self) -> torch.Tensor:
        return self.A

    def fold_receiver_grad(self) -> None:
        if self._rx_grad is not None:
            self.A.grad = self._rx_grad if self.A.grad is None else self.A.grad.add_(self._rx_grad)
            self._rx_grad = None

    def sync_payload(self):
        # sent in fp32 after every optimizer step: a bf16 copy would break AᵀA = I (~1e-3 mismatch)
        return {"A": self.A.detach().float()} if self.learned else {}

    @torch.no_grad()
    def apply_sync(self, payload):
        if "A" in payload:
            self.A.copy_(payload["A"])

    def receiver_grad_bytes_per_step(self) -> int:
        return self.A.numel() * 4 if (self.learned and self.receiver_grad == "exact") else 0

    def diagnostics(self):
        return {"ortho_err": ortho_error(self.A)}
