"""Stage-boundary compressors behind one interface (``base.Compressor``): none, int8, ssn, mapl, mapl-rvq."""
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
    """The one fixed U (d x r) of SSN and the "fixed-shared" ablation; derived from the seed, never sent."""
    return stiefel_random(d_model, comp.rank(d_model), derive_seed(comp.seed, "shared_basis"))


def build_boundary(comp, d_model: int, boundary: int) -> Compressor:
    """The compressor of boundary ``boundary`` for a validated CompressorConfig."""
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
