"""SPEL, spectral steepest descent on the Stiefel manifold St(d, r) = {A : AᵀA = I}, for the projectors A_p,
and the small Stiefel toolkit the compressors, diagnostics and tests share. One step on A with gradient g:

    gR = g - A·sym(Aᵀg)                 Riemannian gradient (tangent projection)
    m  = β·m + (1-β)·gR                 momentum (MAPL's order: project first, then average)
    D  = msign(m)                       spectral-norm LMO direction, U·Vᵀ of m's SVD
    A  <- polar(A - lr·D)               retraction: the nearest point of St(d, r)

``msign``/``polar`` are exact (SVD, the default: on a CPU cheaper than 10 Polar-Express steps) or Polar Express
(Amsel et al., arXiv 2505.16932; on a GPU ~60 small matmuls, where two cuSOLVER SVDs a step sync the host). In
fp32 both hold ‖AᵀA - I‖ <= 1e-5 over a run.
"""
from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch

from .config import POLAR_METHODS

__all__ = ["sym", "tangent_project", "thin_svd", "polar_svd", "polar_express", "msign", "stiefel_random",
           "ortho_error", "principal_angles", "SPEL", "POLAR_METHODS", "POLAR_EXPRESS_COEFFS", "ieee_fp32"]

# Polar Express degree-5 coefficients p(x) = a·x + b·x³ + c·x⁵, one triple per iteration (Algorithm 1 of arXiv
# 2505.16932). The last, the quintic Newton-Schulz map (fixed point 1), repeats past the list.
_PE_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
_PE_LAST = (1.875, -1.25, 0.375)
# p(x/1.01): singular values rounding pushed slightly above 1 still map back into range; the repeated last
# triple stays exact so the fixed point is exactly 1.
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for (a, b, c) in _PE_RAW
) + (_PE_LAST,)


# the per-backend switches (torch >= 2.9): once a caller set TF32 through them, reading the legacy flags raises
_FP32_SWITCHES = (("cuda", "matmul"), ("cudnn", "conv"), ("mkldnn", "matmul"))


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """Full float32 matmuls inside, whatever the caller set (restored after): TF32 and oneDNN's bf16 passes
    (accelerate turns TF32 on with a dynamo backend) round to ~1e-3, and AᵀA = I needs ~1e-6."""
    try:
        saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    except RuntimeError:                 # the caller set precision through the new API
        yield from _ieee_fp32_new_api()
        return
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def _ieee_fp32_new_api() -> Iterator[None]:
    switches = [getattr(getattr(torch.backends, b), op) for b, op in _FP32_SWITCHES]
    saved = [sw.fp32_precision for sw in switches]
    for sw in switches:
        sw.fp32_precision = "ieee"
    try:
        yield
    finally:
        for sw, value in zip(switches, saved):
            sw.fp32_precision = value


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sym(M: torch.Tensor) -> torch.Tensor:
    """Symmetric part (M + Mᵀ)/2 over the last two dims."""
    return 0.5 * (M + M.mT)


def tangent_project(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """G's projection onto the tangent space of St(d, r) at A: the Riemannian gradient (embedded metric)."""
    return G - A @ sym(A.mT @ G)


def thin_svd(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.linalg.svd(X, full_matrices=False)``, retried in float64 (with a RuntimeWarning) when LAPACK does
    not converge: gesdd failed on SPEL's retraction input (singular values all ~1) at step ~2,145 of a MAPL 4x
    run with one thread (tests/data/gesdd-nonconvergent-128x32.pt)."""
    try:
        return torch.linalg.svd(X, full_matrices=False)
    except torch.linalg.LinAlgError:
        if X.dtype == torch.float64:
            raise
        warnings.warn(f"thin_svd: float32 LAPACK SVD of a {tuple(X.shape)} matrix did not converge; retried in "
                      "float64 (mapl.core.optim.thin_svd)", RuntimeWarning, stacklevel=2)
        U, S, Vh = torch.linalg.svd(X.double(), full_matrices=False)
        return U.to(X.dtype), S.to(X.dtype), Vh.to(X.dtype)


def polar_svd(X: torch.Tensor) -> torch.Tensor:
    """The polar factor U·Vᵀ of X (the nearest orthonormal matrix), computed in >= float32, in X's dtype."""
    U, _, Vh = thin_svd(X.to(_work_dtype(X.dtype)))
    return (U @ Vh).to(X.dtype)


def _msign_svd(X: torch.Tensor) -> torch.Tensor:
    """U·sign(Σ)·Vᵀ: singular values at rounding level map to 0, so a rank-deficient momentum takes no
    arbitrary unit step in its null directions (as Polar Express's odd polynomials fix 0)."""
    wd = _work_dtype(X.dtype)
    U, S, Vh = thin_svd(X.to(wd))
    # Same cut-off as torch.linalg.matrix_rank's default: σ_max · max(m, n) · eps.
    tol = S.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * torch.finfo(wd).eps
    keep = (S > tol).to(wd)
    return ((U * keep.unsqueeze(-2)) @ Vh).to(X.dtype)


def polar_express(X: torch.Tensor, steps: int = 10, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Polar Express approximation of the polar factor / msign of X, in X's dtype: ``steps`` iterations on the
    wide orientation (the small r x r Gram matrix), after scaling every singular value into (0, 1).
    ``dtype``: the compute dtype (None: float32, float64 for float64)."""
    if X.ndim < 2:
        raise ValueError(f"polar_express needs a matrix (ndim >= 2), got shape {tuple(X.shape)}")
    if steps < 1:
        raise ValueError(f"polar_express needs steps >= 1, got {steps}")
    cd = _work_dtype(X.dtype) if dtype is None else dtype
    Y = X.to(cd)
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT  # X·Xᵀ is then r x r rather than d x d: far fewer FLOPs
    Y = Y / (torch.linalg.matrix_norm(Y, keepdim=True) * 1.01 + 1e-7)
    n_listed = len(POLAR_EXPRESS_COEFFS)
    for i in range(steps):
        a, b, c = POLAR_EXPRESS_COEFFS[min(i, n_listed - 1)]
        G = Y @ Y.mT
        B = b * G + c * (G @ G)
        Y = a * Y + B @ Y
    if tall:
        Y = Y.mT
    return Y.to(X.dtype)


def msign(X: torch.Tensor, method: str = "svd", steps: int = 10) -> torch.Tensor:
    """The matrix sign U·sign(Σ)·Vᵀ, the spectral-norm LMO direction, exact ("svd") or by Polar Express."""
    if method == "svd":
        return _msign_svd(X)
    if method == "polar_express":
        return polar_express(X, steps=steps)
    raise ValueError(f"unknown msign method {method!r}; allowed: {POLAR_METHODS}")


def _retract(Y: torch.Tensor, method: str, steps: int) -> torch.Tensor:
    """polar(Y) onto St(d, r), always in >= float32: the constraint must hold to ~1e-5 (``method`` checked by SPEL)."""
    return polar_svd(Y) if method == "svd" else polar_express(Y, steps=steps)


def stiefel_random(d: int, r: int, seed: int | torch.Generator | None = None, *,
                   dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """A Haar-distributed point of St(d, r), the one orthonormal-basis helper (projector starts, SSN's U, anchor
    bases): Q of the QR of a float64 Gaussian, column j times sign(R_jj) (plain QR is not Haar). ``seed``: an int
    (a fresh CPU generator: the same matrix on every rank and device), a Generator, or None (global RNG)."""
    if not (0 < r <= d):
        raise ValueError(f"stiefel_random needs 0 < r <= d, got d={d}, r={r}")
    Q = _seeded_haar(d, r, seed) if isinstance(seed, int) else _haar(d, r, seed)
    return Q.to(dtype=dtype, device=device if device is not None else Q.device, copy=True)


@functools.lru_cache(maxsize=32)
def _seeded_haar(d: int, r: int, seed: int) -> torch.Tensor:
    """Cached per process: meta builds (memory plans, FLOP counts) ask for the same bases dozens of times."""
    return _haar(d, r, torch.Generator().manual_seed(seed))


def _haar(d: int, r: int, gen: torch.Generator | None) -> torch.Tensor:
    G = torch.randn(d, r, generator=gen, dtype=torch.float64, device=gen.device if gen is not None else "cpu")
    Q, R = torch.linalg.qr(G, mode="reduced")
    s = torch.sign(torch.diagonal(R))
    s = torch.where(s == 0, torch.ones_like(s), s)
    return Q * s


def ortho_error(A: torch.Tensor) -> float:
    """max |AᵀA - I|, in float64 (so it measures A, not the check)."""
    A64 = A.detach().to(torch.float64)
    r = A64.shape[-1]
    eye = torch.eye(r, dtype=torch.float64, device=A64.device)
    return (A64.mT @ A64 - eye).abs().max().item()


def principal_angles(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The min(ra, rb) principal angles (degrees, ascending, float64) between col(A) and col(B), any bases.
    Angles with cos² > 1/2 come from the sines (Knyazev & Argentati 2002): arccos is ill-conditioned there."""
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[0]:
        raise ValueError(f"principal_angles needs d x ra and d x rb matrices, got {tuple(A.shape)}, "
                         f"{tuple(B.shape)}")
    Qa = torch.linalg.qr(A.detach().to(torch.float64), mode="reduced").Q
    Qb = torch.linalg.qr(B.detach().to(torch.float64), mode="reduced").Q
    if Qa.shape[1] < Qb.shape[1]:
        Qa, Qb = Qb, Qa  # the sine formula needs the larger subspace as the reference
    # svdvals is descending: cos descending = angles ascending; sin must be flipped to match.
    cos = torch.linalg.svdvals(Qa.mT @ Qb).clamp(0.0, 1.0)
    sin = torch.linalg.svdvals(Qb - Qa @ (Qa.mT @ Qb)).clamp(0.0, 1.0).flip(0)
    theta = torch.where(cos**2 > 0.5, torch.arcsin(sin), torch.arccos(cos))
    return torch.sort(torch.rad2deg(theta)).values


class SPEL(torch.optim.Optimizer):
    """SPectral steepest descent on the stiEfeL manifold, for d x r parameters (r <= d); the first step retracts
    a parameter off the manifold onto it.

    ``lr``: the step in spectral norm (MAPL: 0.1 x the Muon LR); ``momentum``: β (0: none); ``polar``: "svd" or
    "polar_express" for msign and the retraction, with ``polar_steps`` iterations (10 reach fp32 accuracy).
    The update is computed in float32 (float64 for float64 parameters) with TF32 off (:func:`ieee_fp32`) and
    the momentum kept in that dtype, so an fp32 parameter stays within ~1e-6 of orthonormal.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 momentum: float = 0.95, polar: str = "svd", polar_steps: int = 10):
        if not lr >= 0.0:
            raise ValueError(f"invalid lr {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum {momentum}: need 0 <= momentum < 1")
        super().__init__(params, dict(lr=lr, momentum=momentum, polar=polar, polar_steps=polar_steps))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["polar"] not in POLAR_METHODS:
            raise ValueError(f"SPEL: unknown polar {group['polar']!r}; allowed: {POLAR_METHODS}")
        if int(group["polar_steps"]) < 1:
            raise ValueError(f"SPEL: polar_steps must be >= 1, got {group['polar_steps']}")
        for p in group["params"]:
            if p.ndim != 2 or p.shape[1] > p.shape[0] or p.shape[1] == 0:
                raise ValueError(
                    f"SPEL optimises Stiefel matrices of shape (d, r) with 0 < r <= d; got a "
                    f"parameter of shape {tuple(p.shape)}")
            if not p.is_floating_point():
                raise ValueError(f"SPEL needs floating-point parameters, got {p.dtype}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with ieee_fp32():
            self._update()
        return loss

    def _update(self) -> None:
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SPEL does not support sparse gradients")
                wdt = _work_dtype(p.dtype)
                # .to() may alias p (fp32 param): nothing below writes into A in place
                A = p.detach().to(wdt)
                g = p.grad.detach().to(wdt)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None or buf.dtype != wdt:
                    # first step, or a buffer load_state_dict cast to a bf16 param's dtype
                    buf = torch.zeros_like(A) if buf is None else buf.to(wdt)
                    state["momentum_buffer"] = buf
                gR = tangent_project(A, g)
                buf.mul_(beta).add_(gR, alpha=1.0 - beta)
                D = msign(buf, method=group["polar"], steps=int(group["polar_steps"]))
                p.copy_(_retract(A - lr * D, group["polar"], int(group["polar_steps"])))
