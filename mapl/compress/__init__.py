"""Stage-boundary compressors, all behind one interface (:class:`~mapl.compress.base.Compressor`).

methods: ``none`` (bf16 wire), ``int8`` (absmax, both legs), ``ssn`` (fixed shared subspace + static
shift + constrained residual writers), ``mapl`` (learned Stiefel projector per boundary + factorized
anchors), ``mapl-rvq`` (mapl + residual VQ of Z with a streamed codebook). Ablations choose the
projector (``spel``/``fixed``/``unconstrained``/``fixed-shared``) and anchor independently.
"""
from __future__ import annotations

import torch

from .base import Compressor, WireTransfer, payload_bytes
from .int8 import Int8Compressor
from .projection import ProjectionCompressor

__all__ = ["Compressor", "WireTransfer", "payload_bytes", "Int8Compressor", "ProjectionCompressor",
           "build_boundary", "projector_basis"]


def projector_basis(d_model: int, r: int, seed: int) -> torch.Tensor:
    """Per-boundary initial A_p: Haar-random orthonormal (QR of a seeded Gaussian, sign-fixed)."""
    g = torch.Generator().manual_seed(seed)
    q, rr = torch.linalg.qr(torch.randn(d_model, r, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(rr)).unsqueeze(0)).float()


def build_boundary(comp, d_model: int, boundary: int, shared_U: torch.Tensor | None = None) -> Compressor:
    """The compressor of boundary ``boundary`` for a resolved, validated CompressorConfig."""
    if comp.method == "none":
        return Compressor(d_model)
    if comp.method == "int8":
        return Int8Compressor(d_model, comp.int8_block)
    r = comp.rank(d_model)
    if comp.projector.kind == "fixed-shared":
        basis = shared_U
    else:
        basis = projector_basis(d_model, r, comp.seed + 100 + boundary)
    proj = ProjectionCompressor(d_model, basis, comp.projector.kind, comp.projector.receiver_grad,
                                method="ssn" if comp.method == "ssn" else "mapl")
    if comp.method != "mapl-rvq":
        return proj
    from .rvq import RVQCompressor           # imported here: optional heavy path
    q = comp.rvq
    return RVQCompressor(proj, groups=q.groups or None, rounds=q.rounds, codebook_size=q.codebook_size,
                         decay=q.decay, sync=q.sync, max_staleness=q.max_staleness, search_with=q.search_with,
                         chunk_elems=q.search_chunk_elems, seed=comp.seed + 200 + boundary)
