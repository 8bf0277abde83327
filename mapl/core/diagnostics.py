"""Boundary diagnostics on held-out activations X_p (what the projector sees): ``captured_energy``
||X_p A_p|| / ||X_p|| (paper Fig. 4b: ~80% learned, ~36% fixed at r = 128), ``pca_energy`` (the best rank-r
basis), principal angles to the PCA subspace and to the next boundary's (paper: ~53 degrees), ``ortho_err``."""
from __future__ import annotations

import torch

from .optim import ortho_error, principal_angles

__all__ = ["boundary_activations", "boundary_diagnostics"]


@torch.no_grad()
def boundary_activations(sm, batches) -> list[torch.Tensor]:
    """X_p of each boundary, (tokens, d) float64, through the real wire (eval mode)."""
    was = sm.training
    sm.eval()
    acts = [[] for _ in range(sm.n_stages - 1)]
    for x, _ in batches:
        inp = None
        for s in range(sm.n_stages - 1):
            acts[s].append(sm.boundary_input(s, inp, x).reshape(-1, sm.model.cfg.d_model).double())
            z = sm.stage_forward(s, inp, x)
            comp = sm.boundaries[str(s)]
            inp = comp.unpack(comp.pack(z), z.dtype)
    sm.train(was)
    return [torch.cat(a) for a in acts]


def _angles(A: torch.Tensor, B: torch.Tensor) -> dict:
    ang = principal_angles(A, B)
    return {"mean": float(ang.mean()), "max": float(ang.max())}


@torch.no_grad()
def boundary_diagnostics(sm, batches) -> list[dict]:
    bases = [None if comp.basis() is None else comp.basis().detach().double() for comp in sm.compressors()]
    acts = boundary_activations(sm, batches)
    out = []
    for p, (A, X) in enumerate(zip(bases, acts)):
        total = float(X.norm())
        d = {"boundary": p, "activation_rms": float(X.pow(2).mean().sqrt())}
        if A is not None:
            r = A.shape[1]
            # top-r right singular vectors of X: the PCA subspace (uncentred, as the projector sees X)
            _, S, Vh = torch.linalg.svd(X, full_matrices=False)
            pca = Vh[:r].T
            d.update({"rank": r,
                      "captured_energy": float((X @ A).norm()) / total,
                      "pca_energy": float(S[:r].pow(2).sum().sqrt()) / total,
                      "angles_to_pca_deg": _angles(A, pca),
                      "ortho_err": ortho_error(A)})
            if p + 1 < len(bases) and bases[p + 1] is not None:
                d["angles_to_next_deg"] = _angles(A, bases[p + 1])
        out.append(d)
    return out
