"""The one interface every stage-boundary compressor implements (docs/architecture.md, "Contracts").

In-graph ``encode``/``decode`` are differentiable; ``pack``/``unpack`` (forward) and ``pack_grad``/``unpack_grad``
(backward) make exactly the tensors handed to torch.distributed. Anchors are the stage's job, not the
compressor's. Every optional capability has a default here (the identity's answer), so callers never probe.
"""
from __future__ import annotations

import math
import zlib
from typing import ClassVar

import torch
import torch.nn as nn

from . import gradwire
from .health import BoundaryHealth

__all__ = ["Compressor", "StiefelParameter", "WireTransfer", "payload_bytes", "spec_bytes", "WIRE_DTYPE",
           "tensor_checksum"]

# Float payloads travel as bf16, the paper's precision; the uncompressed reference is bf16 too.
WIRE_DTYPE = torch.bfloat16


def payload_bytes(payload: list[torch.Tensor]) -> int:
    """Bytes of a payload as handed to torch.distributed (no framing: gloo/NCCL send raw storage)."""
    return sum(t.numel() * t.element_size() for t in payload)


def spec_bytes(spec: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of a payload described by ``payload_spec``: the size the receiver allocates."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt in spec)


def tensor_checksum(*tensors: torch.Tensor) -> int:
    """CRC32 of the exact bytes; two sides agree iff their state is bit-identical."""
    crc = 0
    for t in tensors:
        raw = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(raw, crc)
    return crc


class StiefelParameter(nn.Parameter):
    """A parameter on St(d, r) = {A : AᵀA = I}: SPEL optimises exactly these."""

    def __new__(cls, data=None, requires_grad=True):
        return super().__new__(cls, data, requires_grad)


class Compressor(nn.Module):
    """The identity on a bf16 wire (method ``none``); subclasses override what differs."""

    method: ClassVar[str] = "none"
    learned: bool = False          # holds a learned projector (synced to the receiver every step)
    grad_wire: str = "same"        # the backward message (mapl.core.compress.gradwire); build_boundary sets it

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.wire_dtype = WIRE_DTYPE   # float payload dtype; tests use float64 for gradcheck
        self.health = BoundaryHealth()  # what this boundary sends, read by the loop (observes only)

    # ---- in-graph -------------------------------------------------------------------------
    @property
    def code_dim(self) -> int:
        """Width of z (d for the identity, r for projections)."""
        return self.d_model

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z

    # ---- wire -----------------------------------------------------------------------------
    def pack(self, z: torch.Tensor) -> list[torch.Tensor]:
        return [z.detach().to(self.wire_dtype).contiguous()]

    def unpack(self, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return payload[0].to(dtype)

    def pack_grad(self, g: torch.Tensor) -> list[torch.Tensor]:
        return gradwire.pack(self.grad_wire, g, self.wire_dtype)

    def unpack_grad(self, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return gradwire.unpack(self.grad_wire, payload, dtype)

    def payload_roles(self, direction: str) -> list[str]:
        """Per payload tensor: "data" (the message) or "sync" (piggybacked shared state, metered as overhead)."""
        return ["data"] * len(self.payload_spec((1, 1), direction))

    def payload_spec(self, lead_shape: tuple[int, ...], direction: str,
                     pending: int = 0) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of a payload for ``lead_shape`` = (B, T), what a receiver allocates. It may follow
        the compressor's state (RVQ's k-means init message is larger): ``pending`` is how many forward
        receives are posted ahead and not yet unpacked."""
        if direction == "bwd":
            return gradwire.spec(self.grad_wire, lead_shape, self.code_dim, self.wire_dtype)
        return [((*lead_shape, self.code_dim), self.wire_dtype)]

    def wire_bytes_per_token(self, direction: str) -> float:
        """Declared bytes per token, ``direction`` in {"fwd", "bwd"}; token ids are counted apart."""
        _check_direction(direction)
        # per-token size = bytes of the payload for one sequence of T tokens, divided by T; data only
        T = 64
        return spec_bytes(self._role_spec((1, T), direction, "data")) / T

    def sync_bytes_per_microbatch(self) -> int:
        """Declared "sync" bytes piggybacked on every forward message, independent of (B, T)."""
        return spec_bytes(self._role_spec((1, 1), "fwd", "sync"))

    def one_off_sync_bytes(self) -> int:
        """Piggybacked bytes sent once per run (RVQ: the whole codebook with the k-means init)."""
        return 0

    def wire_efficiency_floor(self, direction: str) -> float:
        """Bits per token a message cannot do without; wire efficiency = floor / measured bytes."""
        _check_direction(direction)
        if direction == "bwd":
            return gradwire.floor_bits(self.grad_wire, self.code_dim, self.wire_dtype)
        return float(self.code_dim * torch.finfo(self.wire_dtype).bits)

    def _role_spec(self, lead_shape, direction: str, role: str):
        return [s for s, r in zip(self.payload_spec(lead_shape, direction), self.payload_roles(direction)) if r == role]

    # ---- shared state ---------------------------------------------------------------------
    def sync_payload(self) -> dict[str, torch.Tensor]:
        """Sender -> receiver state after each optimizer step (empty when nothing is learned)."""
        return {}

    def apply_sync(self, payload: dict[str, torch.Tensor]) -> None:
        pass

    def sync_bytes_per_step(self) -> int:
        return payload_bytes(list(self.sync_payload().values()))

    def checksum(self) -> int:
        return tensor_checksum(*self.sync_payload().values()) if self.sync_payload() else 0

    def diagnostics(self) -> dict:
        return {}

    def observe(self, z: torch.Tensor) -> None:
        """Record a forward message's z in the health window (whoever packs a message calls this)."""
        self.health.observe(z, self.training)

    def health_report(self) -> dict:
        """The health window since the last call (max |z|, RMS), then a new one; quantisers add their state."""
        return self.health.read()

    # ---- optional capabilities (defaults: nothing to do) -------------------------------------
    def basis(self) -> torch.Tensor | None:
        """The d x r projector basis (A_p or SSN's U), or None for methods without one."""
        return None

    def fold_receiver_grad(self) -> None:
        """Add the step's receiver-side gradient to the owner's (projections with ``receiver_grad="exact"``)."""

    def receiver_grad_bytes_per_step(self) -> int:
        """Bytes of the receiver-side gradient sent back to the sender once per step."""
        return 0

    def check_sync(self, *, raise_on_error: bool = True) -> dict:
        """Health of state that must match across the boundary beyond ``checksum`` (RVQ staleness)."""
        return {"ok": True}


def _check_direction(direction: str) -> None:
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction={direction!r} is invalid; allowed: 'fwd', 'bwd'")


class WireTransfer(torch.autograd.Function):
    """z -> unpack(pack(z)) forward, g -> unpack_grad(pack_grad(g)) backward, metering both legs: the
    single-process pipeline computes what the multi-process runtime does (same rounding, same STE)."""

    @staticmethod
    def forward(ctx, z, compressor: Compressor, meter, boundary: int):
        compressor.observe(z)
        payload = compressor.pack(z)
        if meter is not None:
            meter.add_payload(boundary, "fwd", payload, compressor.payload_roles("fwd"), tokens=z.shape[0] * z.shape[1])
        ctx.compressor, ctx.meter, ctx.boundary, ctx.dtype = compressor, meter, boundary, z.dtype
        return compressor.unpack(payload, z.dtype)

    @staticmethod
    def backward(ctx, g):
        payload = ctx.compressor.pack_grad(g)
        if ctx.meter is not None:
            ctx.meter.add_payload(ctx.boundary, "bwd", payload, ctx.compressor.payload_roles("bwd"),
                                  tokens=g.shape[0] * g.shape[1])
        return ctx.compressor.unpack_grad(payload, ctx.dtype), None, None, None
