"""Stage-boundary compressors, all behind one interface (:class:`~mapl.core.compress.base.Compressor`).

methods: ``none`` (bf16 wire), ``int8`` (absmax, both legs), ``ssn`` (fixed shared subspace + static
shift + constrained residual writers), ``mapl`` (learned Stiefel projector per boundary + factorized
anchors), ``mapl-rvq`` (mapl + residual VQ of Z with a streamed codebook). Ablations choose the
projector (``spel``/``fixed``/``unconstrained``/``fixed-shared``) and anchor independently.

    >>> comp = build_boundary(cfg.compressor.validate(d_model), d_model, boundary=0)
"""
from __future__ import annotations

import torch

from ..optim import stiefel_random
from ..seeds import derive_seed
from .base import Compressor, StiefelParameter, WireTransfer, payload_bytes
from .int8 import Int8Compressor
from .projection import ProjectionCompressor

__all__ = ["Compressor", "StiefelParameter", "WireTransfer", "payload_bytes", "Int8Compressor",
           "ProjectionCompressor", "build_boundary", "shared_basis"]


def shared_basis(comp, d_model: int) -> torch.Tensor:
    """The one fixed U (d x r) shared by every boundary: SSN's subspace and the "fixed-shared"
    projector ablation. Every rank derives it from the seed, so it is never sent."""
    return stiefel_random(d_model, comp.rank(d_model), derive_seed(comp.seed, "shared_basis"))


def build_boundary(comp, d_model: int, boundary: int) -> Compressor:
    """The compressor of boundary ``boundary`` for a resolved, validated CompressorConfig."""
    if comp.method == "none":
        return Compressor(d_model)
    if comp.method == "int8":
        return Int8Compressor(d_model, comp.int8_block)
    if comp.projector.kind == "fixed-shared":
        basis = shared_basis(comp, d_model)
    else:
        basis = stiefel_random(d_model, comp.rank(d_model), derive_seed(comp.seed, "projector", boundary))
    proj = ProjectionCompressor(d_model, basis, comp.projector.kind, comp.projector.receiver_grad,
                                method="ssn" if comp.method == "ssn" else "mapl")
    proj.grad_wire = comp.grad_wire
    if comp.method != "mapl-rvq":
        return proj
    from .rvq import RVQCompressor, RVQSettings           # imported here: optional heavy path
    rvq = RVQCompressor(proj, RVQSettings.from_config(comp.rvq), seed=derive_seed(comp.seed, "rvq", boundary))
    rvq.grad_wire = comp.grad_wire
    return rvq
