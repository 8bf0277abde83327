"""SPEL: spectral steepest descent on the Stiefel manifold, for the per-boundary projector A_p.

MAPL keeps each boundary projector on St(d, r) = {A in R^{d x r} : AᵀA = I_r},
r <= d, so that Aᵀ is the exact left inverse of A and compress/decompress is an isometry on col(A).
One SPEL step on a parameter A with Euclidean gradient g is

    gR = g - A·sym(Aᵀg)                 Riemannian gradient (tangent projection, embedded metric)
    m  = β·m + (1-β)·gR                 heavy-ball momentum (MAPL order: project first, then average)
    D  = msign(m)                       spectral-norm LMO direction, U·Vᵀ of m's SVD
    A  <- polar(A - lr·D)               retraction: nearest point of St(d, r) (polar factor)

``msign``/``polar`` are computed either exactly (SVD) or with Polar Express (Amsel et al.,
arXiv 2505.16932), the odd-polynomial iteration the paper names. Both hold the retraction to
‖AᵀA - I‖ <= 1e-5 over a run when computed in fp32 (10 Polar-Express steps; a few bf16 steps cannot).
SVD is the default and the CPU choice: on a CPU an fp32 SVD of a d x 256 matrix is cheaper than 10
Polar-Express iterations (benchmarks/compress.py --paper-shape). On a GPU choose ``polar_express``:
it is ~60 small matmuls (~6 GFLOP per step at d = 1024, r = 256, about a millisecond), where two
cuSOLVER SVDs per step are latency-bound and synchronise with the host.

Besides the optimizer this module holds the small Stiefel toolkit the compressors, diagnostics and
tests share: ``stiefel_random`` (Haar init), ``ortho_error``, ``principal_angles``.
"""
from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch

from .config import POLAR_METHODS

__all__ = [
    "sym",
    "tangent_project",
    "thin_svd",
    "polar_svd",
    "polar_express",
    "msign",
    "stiefel_random",
    "ortho_error",
    "principal_angles",
    "SPEL",
    "POLAR_METHODS",
    "POLAR_EXPRESS_COEFFS",
    "ieee_fp32",
]

# Polar Express degree-5 coefficients p(x) = a·x + b·x³ + c·x⁵, one triple per iteration
# (Algorithm 1 of arXiv 2505.16932, repo NoahAmsel/PolarExpress). The last triple is the classical quintic
# Newton-Schulz map (fixed point 1, cubic convergence) and is repeated for every step past the list.
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
# Safety factor: (a/1.01, b/1.01³, c/1.01⁵) is p(x/1.01), i.e. each polynomial is stretched so that
# singular values pushed slightly above 1 by rounding are still mapped back into range. The last
# (repeated) triple is left exact so the iteration's fixed point is exactly 1.
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for (a, b, c) in _PE_RAW
) + (_PE_LAST,)


# the new (torch >= 2.9) per-backend switches, used when a caller set TF32 through them: reading the
# legacy flags then raises (PyTorch refuses a mix of the two APIs)
_FP32_SWITCHES = (("cuda", "matmul"), ("cudnn", "conv"), ("mkldnn", "matmul"))


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """Full float32 matmuls inside, whatever the caller set; its settings are restored after.

    TF32 (cuBLAS, cuDNN) and oneDNN's bf16 passes for float32 (``set_float32_matmul_precision``
    'high'/'medium': accelerate switches TF32 on when a dynamo backend is configured) round the
    operands to ~1e-3; Polar Express then holds AᵀA = I only to that, not to the ~1e-6 the retraction
    needs. Through whichever API the caller used: the legacy flags, or the per-backend
    ``fp32_precision`` switches once those are in use.
    """
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
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sym(M: torch.Tensor) -> torch.Tensor:
    """Symmetric part (M + Mᵀ)/2 over the last two dims."""
    return 0.5 * (M + M.mT)


def tangent_project(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Orthogonal projection of G onto the tangent space of St(d, r) at A: G - A·sym(AᵀG).

    Under the embedded (Euclidean) metric this is the Riemannian gradient when G is the Euclidean
    one. The result ξ satisfies Aᵀξ + ξᵀA = 0 (A must be orthonormal for that to hold exactly).
    """
    return G - A @ sym(A.mT @ G)


def thin_svd(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.linalg.svd(X, full_matrices=False)``, retried in float64 when LAPACK does not converge.

    Why hand-written: LAPACK's divide-and-conquer SVD (gesdd, torch's CPU path) can fail to converge on a
    float32 matrix whose singular values are all ~1, which is exactly SPEL's retraction input A - lr·D.
    It happened at step ~2,145 of a 3,000-step MAPL 4x run (seed 0) with one thread, deterministically
    (tests/data/gesdd-nonconvergent-128x32.pt; the same matrix converges with two threads and in float64).
    The retry changes nothing where float32 converges; where it does not, the float64 factors are the
    same ones to float32 rounding, returned in X's dtype. A retry is reported (a RuntimeWarning, once per
    process: Python's default filter), so a run that needed it says so in its log.
    """
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
    """Exact polar factor U·Vᵀ of X (thin SVD), computed in >= float32, returned in X's dtype.

    This is the nearest matrix with orthonormal columns (rows, if X is wide) in Frobenius norm, so
    on St(d, r) it is the polar retraction; for an orthonormal X it returns X.
    """
    U, _, Vh = thin_svd(X.to(_work_dtype(X.dtype)))
    return (U @ Vh).to(X.dtype)


def _msign_svd(X: torch.Tensor) -> torch.Tensor:
    """U·sign(Σ)·Vᵀ: like polar_svd, but singular values at rounding level map to 0, not 1.

    A momentum matrix can be rank deficient (e.g. a rank-1 gradient); plain U·Vᵀ would then add an
    arbitrary unit step in the null directions, whereas msign's definition (and Polar Express,
    whose odd polynomials fix 0) leaves them at 0. Equal to polar_svd(X) when X has full rank.
    """
    wd = _work_dtype(X.dtype)
    U, S, Vh = thin_svd(X.to(wd))
    # Same cut-off as torch.linalg.matrix_rank's default: σ_max · max(m, n) · eps.
    tol = S.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * torch.finfo(wd).eps
    keep = (S > tol).to(wd)
    return ((U * keep.unsqueeze(-2)) @ Vh).to(X.dtype)


def polar_express(X: torch.Tensor, steps: int = 10, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Polar Express approximation of the polar factor / msign of X, returned in X's dtype.

    ``steps`` iterations of ``A = X·Xᵀ; B = b·A + c·A²; X = a·X + B·X`` with the coefficients in
    POLAR_EXPRESS_COEFFS (the last one repeated past 8 steps), on the wide orientation (a tall input
    is transposed, so the Gram matrix is the small r x r one), after scaling by
    ‖X‖_F·1.01 + 1e-7 so every singular value starts in (0, 1).

    ``dtype`` is the compute dtype: None means float32 (float64 if X is float64); bf16 is allowed
    for the msign direction, where accuracy barely matters, but not advisable for a retraction.
    Singular values that are exactly 0 stay 0 (odd polynomials), so msign(0) = 0.
    """
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


def msign(X: torch.Tensor, method: str = "svd", steps: int = 10,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Matrix sign U·sign(Σ)·Vᵀ of X by ``method`` ("svd": exact; "polar_express": ``steps``
    iterations in compute ``dtype``, see polar_express). The spectral-norm LMO direction:
    ‖msign(X)‖₂ = 1 and ⟨X, msign(X)⟩ = ‖X‖_* (nuclear norm)."""
    if method == "svd":
        return _msign_svd(X)
    if method == "polar_express":
        return polar_express(X, steps=steps, dtype=dtype)
    raise ValueError(f"unknown msign method {method!r}; allowed: {POLAR_METHODS}")


def _retract(Y: torch.Tensor, method: str, steps: int) -> torch.Tensor:
    """polar(Y) onto St(d, r), always in >= float32: the constraint must hold to ~1e-5."""
    if method == "svd":
        return polar_svd(Y)
    if method == "polar_express":
        return polar_express(Y, steps=steps, dtype=_work_dtype(Y.dtype))
    raise ValueError(f"unknown polar method {method!r}; allowed: {POLAR_METHODS}")


def stiefel_random(d: int, r: int, seed: int | torch.Generator | None = None, *,
                   dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """A Haar-distributed point of St(d, r): Q of the thin QR of a d x r Gaussian, with column j
    multiplied by sign(R_jj). The one orthonormal-basis helper: projector starting points, SSN's
    shared U and the anchors' fixed bases all come from here (``stiefel_random(c, r, s).T`` for
    orthonormal rows).

    Plain QR output is not Haar (LAPACK's sign convention biases it); the sign fix makes the
    factorisation unique (R with positive diagonal), hence Q = G·R⁻¹ inherits the Gaussian's
    rotation invariance. The Gaussian is drawn and factorised in float64, then cast, so the result
    depends only on the seed (and is orthonormal to the target dtype's precision).

    ``seed``: an int (a fresh CPU generator, so every rank and every device gets the same matrix),
    a Generator (drawn on its device), or None (the global CPU RNG). ``device``: where the result
    goes (default: where it was drawn).
    """
    if not (0 < r <= d):
        raise ValueError(f"stiefel_random needs 0 < r <= d, got d={d}, r={r}")
    Q = _seeded_haar(d, r, seed) if isinstance(seed, int) else _haar(d, r, seed)
    return Q.to(dtype=dtype, device=device if device is not None else Q.device, copy=True)


@functools.lru_cache(maxsize=32)
def _seeded_haar(d: int, r: int, seed: int) -> torch.Tensor:
    """An int seed names one matrix: computed once per process and copied out (the meta builds behind memory
    plans and FLOP counts ask for the same bases dozens of times; a 2048 x 256 float64 QR each time dominated)."""
    return _haar(d, r, torch.Generator().manual_seed(seed))


def _haar(d: int, r: int, gen: torch.Generator | None) -> torch.Tensor:
    G = torch.randn(d, r, generator=gen, dtype=torch.float64, device=gen.device if gen is not None else "cpu")
    Q, R = torch.linalg.qr(G, mode="reduced")
    s = torch.sign(torch.diagonal(R))
    s = torch.where(s == 0, torch.ones_like(s), s)
    return Q * s


def ortho_error(A: torch.Tensor) -> float:
    """max |AᵀA - I| over all entries, accumulated in float64 (so it measures A, not the check)."""
    A64 = A.detach().to(torch.float64)
    r = A64.shape[-1]
    eye = torch.eye(r, dtype=torch.float64, device=A64.device)
    return (A64.mT @ A64 - eye).abs().max().item()


def principal_angles(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Principal angles (degrees, ascending) between col(A) and col(B), A: d x ra, B: d x rb.

    Both inputs are orthonormalised by QR in float64 first, so any basis of the subspace works.
    cos θ are the singular values of QaᵀQb; since arccos is ill-conditioned for tiny angles, angles
    whose cos² > 1/2 are taken from the sines instead (singular values of Qb - Qa·QaᵀQb,
    Knyazev & Argentati 2002), which resolves near-identical subspaces down to ~1e-14 rad.
    Returns min(ra, rb) angles as a float64 tensor.
    """
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
    """SPectral steepest descent on the stiEfeL manifold (MCSD/SPEL, as used by MAPL).

    Every parameter must be a d x r matrix with r <= d whose columns are (meant to be) orthonormal;
    the first step retracts it onto St(d, r) even if it starts off it. Per step, per parameter:

        gR = g - A·sym(Aᵀg);  m = β·m + (1-β)·gR;  D = msign(m);  A <- polar(A - lr·D)

    Args:
        lr: step length in spectral norm (‖lr·D‖₂ = lr). MAPL uses 0.1 x the Muon LR; the caller
            computes it.
        momentum: β of the heavy-ball average (0 disables it).
        polar: "svd" (exact, default) or "polar_express": method of the retraction.
        polar_steps: Polar-Express iterations (retraction and, unless direction_steps is given,
            direction); ignored for "svd". 10 reaches fp32 accuracy for r up to a few hundred.
        direction_polar: method for msign(m); defaults to ``polar``.
        direction_steps: Polar-Express iterations for msign(m); defaults to ``polar_steps``.
        weight_decay: decoupled decay A <- (1 - lr·wd)·A before the step. polar(c·Y) = polar(Y),
            so on the manifold this only rescales the effective lr by 1/(1 - lr·wd); it exists for
            parity with other SPEL implementations (NVIDIA Emerging-Optimizers) and ablations.
        nesterov: use (1-β)·gR + β·m instead of m as the msign input (Muon's convention).

    Precision: the update is computed in float32 (float64 for float64 parameters) whatever the
    parameter or gradient dtype, with TF32 and reduced-precision float32 matmuls off (:func:`ieee_fp32`,
    whatever the caller or a launcher set), and the momentum buffer is kept in that dtype, so an fp32 parameter
    stays within ~1e-6 of orthonormal even with bf16-rounded gradients. A bf16 *parameter* is
    only orthonormal to bf16 rounding (~4e-3) after the final cast. Note that
    ``load_state_dict`` casts state to the parameter dtype (torch policy), so for a bf16 parameter
    the reloaded momentum is bf16-rounded; it is upcast again on the next step.

    The momentum buffer holds tangent vectors of earlier iterates and is not re-projected at the
    new point (MAPL order: project the gradient, then average; MCSD instead projects the momentum).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 momentum: float = 0.95, polar: str = "svd", polar_steps: int = 10,
                 direction_polar: str | None = None, direction_steps: int | None = None,
                 weight_decay: float = 0.0, nesterov: bool = False):
        if not lr >= 0.0:
            raise ValueError(f"invalid lr {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum {momentum}: need 0 <= momentum < 1")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, polar=polar, polar_steps=polar_steps,
                        direction_polar=direction_polar, direction_steps=direction_steps,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # Resolve "same as the retraction" defaults per group, so a group overriding ``polar``
        # also gets that direction method unless it says otherwise.
        if group["direction_polar"] is None:
            group["direction_polar"] = group["polar"]
        if group["direction_steps"] is None:
            group["direction_steps"] = group["polar_steps"]
        for key in ("polar", "direction_polar"):
            if group[key] not in POLAR_METHODS:
                raise ValueError(f"SPEL: unknown {key} {group[key]!r}; allowed: {POLAR_METHODS}")
        for key in ("polar_steps", "direction_steps"):
            if int(group[key]) < 1:
                raise ValueError(f"SPEL: {key} must be >= 1, got {group[key]}")
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
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SPEL does not support sparse gradients")
                wdt = _work_dtype(p.dtype)
                # .to() may alias p (fp32 param): nothing below writes into A in place.
                A = p.detach().to(wdt)
                g = p.grad.detach().to(wdt)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None or buf.dtype != wdt:
                    # First step, or a buffer that load_state_dict cast to a bf16 param's dtype.
                    buf = torch.zeros_like(A) if buf is None else buf.to(wdt)
                    state["momentum_buffer"] = buf
                gR = tangent_project(A, g)
                buf.mul_(beta).add_(gR, alpha=1.0 - beta)
                m = gR.mul_(1.0 - beta).add_(buf, alpha=beta) if group["nesterov"] else buf
                D = msign(m, method=group["direction_polar"], steps=int(group["direction_steps"]))
                Y = A * (1.0 - lr * wd) if wd != 0.0 else A
                Y = Y - lr * D
                p.copy_(_retract(Y, group["polar"], int(group["polar_steps"])))
