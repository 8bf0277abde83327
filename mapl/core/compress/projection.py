"""Orthonormal projection to r dimensions: MAPL (learned A_p on the Stiefel manifold, SPEL), SSN (one
fixed shared U) and the projector ablations (fixed random per boundary, learned without constraint).

Forward message: Z = X A (r bf16 values per token); backward: dL/dZ (r values). Because AᵀA = I, Aᵀ is
the exact left inverse, so decode(encode(x)) = x for every x in col(A) (SSN's lossless guarantee).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..optim import ortho_error
from .base import Compressor, StiefelParameter

__all__ = ["ProjectionCompressor"]


class _ReceiverSide(torch.autograd.Function):
    """A as the receiver's copy sees it. Forward: A. Backward: the receiver-side term G_X̂ᵀZ is kept
    apart (``comp._rx_grad``) instead of being summed into A.grad micro-batch by micro-batch, and is
    folded in once per step by ``fold_receiver_grad``. This is what the multi-process runtime must do
    (the term is computed on another process and sent back once per step), so both runtimes add the
    same floating-point numbers in the same order and stay bit-identical."""

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
    """``projector``: "spel" (learned, Stiefel, optimised by mapl.core.optim.SPEL), "unconstrained" (learned,
    plain optimiser), "fixed" (random orthonormal per boundary), "fixed-shared" (SSN's one U)."""

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
        """Add the receiver-side gradient of A (accumulated over the step's micro-batches) to A.grad."""
        if self._rx_grad is not None:
            self.A.grad = self._rx_grad if self.A.grad is None else self.A.grad.add_(self._rx_grad)
            self._rx_grad = None

    def sync_payload(self):
        # learned A_p is shipped to the receiver after every optimizer step, in fp32: a bf16 copy would
        # break AᵀA = I on the receiver side (encode/decode mismatch of ~1e-3)
        return {"A": self.A.detach().float()} if self.learned else {}

    @torch.no_grad()
    def apply_sync(self, payload):
        if "A" in payload:
            self.A.copy_(payload["A"])

    def receiver_grad_bytes_per_step(self) -> int:
        """Receiver-side gradient of A_p sent back (d x r fp32) when receiver_grad == "exact"."""
        return self.A.numel() * 4 if (self.learned and self.receiver_grad == "exact") else 0

    def diagnostics(self):
        return {"ortho_err": ortho_error(self.A)}
