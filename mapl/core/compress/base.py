"""The one interface every stage-boundary compressor implements.

A boundary p sits between stage p (the sender) and stage p+1 (the receiver). Two levels:

* in-graph, differentiable: ``encode(x) -> z`` runs on the sender, ``decode(z) -> x_hat`` on the
  receiver. Token anchors are *not* part of this: the stage subtracts its anchor before ``encode``
  and adds its own after ``decode`` (mapl/core/stages.py), so anchors compose with any compressor.
* out-of-graph, what crosses a process: ``pack(z) -> [tensors]`` / ``unpack([tensors]) -> z`` for the
  forward message and ``pack_grad`` / ``unpack_grad`` for the backward message. Every tensor in a
  payload is exactly what is handed to torch.distributed, so ``payload_bytes`` is the measured size;
  ``wire_bytes_per_token`` is the declared size. Tests assert they agree.

Quantisers (int8, RVQ) quantise in ``pack``; :class:`WireTransfer` routes the forward value through
pack -> unpack and the gradient through pack_grad -> unpack_grad, so the single-process pipeline sees
exactly what the multi-process one receives, and the straight-through estimator falls out: the
receiver's gradient on the dequantised z is passed to z unchanged (after its own wire trip).

State that must match on both sides (projector A_p, RVQ codebooks) is synchronised explicitly with
``sync_payload`` / ``apply_sync``; the bytes are metered as overhead and ``checksum`` detects desync.

Every optional capability has a default here (the identity compressor's answer), so callers never
probe for a method: ``learned``, ``basis``, ``fold_receiver_grad``, ``receiver_grad_bytes_per_step``,
``sync_payload``/``apply_sync``/``sync_bytes_per_step``/``checksum``, ``sync_bytes_per_microbatch``,
``one_off_sync_bytes``, ``check_sync``, ``check_finite``, ``diagnostics``, ``wire_efficiency_floor``.
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
    """A parameter constrained to the Stiefel manifold St(d, r) = {A : AᵀA = I}. The type is the
    constraint: SPEL optimises exactly the StiefelParameters, and checks find them by type."""

    def __new__(cls, data=None, requires_grad=True):
        return super().__new__(cls, data, requires_grad)


class Compressor(nn.Module):
    """Base class: the identity on a bf16 wire (method ``none``). Subclasses override what differs;
    every optional capability has a default here, so callers never probe for it."""

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
        """One role per payload tensor: "data" (the message itself) or "sync" (piggybacked shared
        state, e.g. a streamed codebook slice). The meter books "sync" bytes as overhead."""
        return ["data"] * len(self.payload_spec((1, 1), direction))

    def payload_spec(self, lead_shape: tuple[int, ...], direction: str,
                     pending: int = 0) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of a payload for ``lead_shape`` = (B, T): receivers allocate from this. It
        may follow the compressor's state (RVQ: the message carrying the k-means init is larger), so a
        receiver that posts receives ahead says how many earlier forward messages it has posted but
        not yet unpacked (``pending``). Declarations use the stateless ``wire_bytes_per_token``,
        ``sync_bytes_per_microbatch`` and ``one_off_sync_bytes``."""
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
        """Declared bytes of shared state piggybacked on every forward message (role "sync"),
        independent of the message's (B, T); 0 for stateless compressors."""
        return spec_bytes(self._role_spec((1, 1), "fwd", "sync"))

    def one_off_sync_bytes(self) -> int:
        """Declared piggybacked bytes sent once per run on top of ``sync_bytes_per_microbatch``
        (RVQ with stream sync: the whole codebook right after the k-means init)."""
        return 0

    def wire_efficiency_floor(self, direction: str) -> float:
        """The information floor in bits per token: what one token's message cannot do without
        (here: ``code_dim`` values in the wire dtype). Wire efficiency = floor / measured bytes."""
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
        """Record a forward message's z in the running health window (called by whoever packs a
        training or evaluation message: :class:`WireTransfer`, the runtime's sender)."""
        self.health.observe(z, self.training)

    def health_report(self) -> dict:
        """The health window since the last call (max |z| and RMS, training and evaluation messages),
        then a new window; quantisers add their own state (RVQ: codebook norms, sender-receiver gap)."""
        return self.health.read()

    # ---- optional capabilities (defaults: nothing to do) -------------------------------------
    def basis(self) -> torch.Tensor | None:
        """The d x r projector basis (A_p or SSN's U), or None for methods without one."""
        return None

    def fold_receiver_grad(self) -> None:
        """Add the receiver-side gradient accumulated over the step's micro-batches to the owner's
        parameter gradient (projections with ``receiver_grad="exact"``)."""

    def receiver_grad_bytes_per_step(self) -> int:
        """Bytes of the receiver-side gradient sent back to the sender once per step."""
        return 0

    def check_sync(self, *, raise_on_error: bool = True) -> dict:
        """Health of state that must match across the boundary beyond ``checksum`` (RVQ staleness)."""
        return {"ok": True}

    @torch.no_grad()
    def check_finite(self, boundary: int, step: int) -> None:
        """Raise FloatingPointError naming the first non-finite parameter (the learned projector),
        after an optimizer step. One host sync per parameter; none for stateless compressors."""
        for name, prm in self.named_parameters():
            if not torch.isfinite(prm).all():
                raise FloatingPointError(f"non-finite projector {name} of boundary {boundary} (sender: stage "
                                         f"{boundary}) after the optimizer step of step {step}; the last good "
                                         "checkpoint is kept")


def _check_direction(direction: str) -> None:
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction={direction!r} is invalid; allowed: 'fwd', 'bwd'")


class WireTransfer(torch.autograd.Function):
    """z -> unpack(pack(z)) forward, g -> unpack_grad(pack_grad(g)) backward, metering both legs.

    The single-process pipeline puts one of these at every boundary, so it computes what the
    multi-process runtime computes (same rounding, same quantisation, same STE).
    """

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
