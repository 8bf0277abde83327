"""Tests for mapl/core/optim.py: Stiefel toolkit (tangent projection, polar factors, msign, Haar init,
principal angles) and the SPEL optimizer (manifold invariant, first-order behaviour, PCA recovery,
bf16 gradients, state_dict round trip). Small shapes throughout: the whole file runs in seconds."""
from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

import pytest
import torch

from mapl.core.optim import (
    POLAR_EXPRESS_COEFFS,
    SPEL,
    msign,
    ortho_error,
    polar_express,
    polar_svd,
    principal_angles,
    stiefel_random,
    sym,
    tangent_project,
    thin_svd,
)

SEEDS = [0, 1, 2, 3, 4]
F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    """The matrices here are tiny: intra-op threads only add contention on shared 2-core boxes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _matrix_with_singular_values(d: int, r: int, s: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """d x r matrix U·diag(s)·Vᵀ with Haar U, V: controls conditioning exactly."""
    U = stiefel_random(d, r, g, dtype=F64)
    V = stiefel_random(r, r, g, dtype=F64)
    return (U * s.to(F64)) @ V.T


# ---------------------------------------------------------------------------------------------
# Toolkit
# ---------------------------------------------------------------------------------------------

def test_polar_express_coefficients_match_paper():
    # 7 listed triples with the 1.01 safety factor, then the exact quintic Newton-Schulz map.
    assert len(POLAR_EXPRESS_COEFFS) == 8
    assert POLAR_EXPRESS_COEFFS[-1] == (1.875, -1.25, 0.375)
    a, b, c = POLAR_EXPRESS_COEFFS[0]
    assert a == pytest.approx(8.28721201814563 / 1.01, rel=1e-15)
    assert b == pytest.approx(-23.595886519098837 / 1.01**3, rel=1e-15)
    assert c == pytest.approx(17.300387312530933 / 1.01**5, rel=1e-15)
    # The exact last map fixes 1; the safety-scaled ones are p(x / 1.01).
    assert sum(POLAR_EXPRESS_COEFFS[-1]) == 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_stiefel_random_orthonormal_deterministic_and_sign_fixed(seed):
    A = stiefel_random(40, 12, _gen(seed), dtype=F64)
    assert A.shape == (40, 12) and A.dtype == F64
    assert ortho_error(A) < 1e-13
    assert torch.equal(A, stiefel_random(40, 12, _gen(seed), dtype=F64))
    assert not torch.allclose(A, stiefel_random(40, 12, _gen(seed + 100), dtype=F64))
    # Sign correction: A = G·R⁻¹ with R upper triangular, positive diagonal  <=>  AᵀG is that R.
    G = torch.randn(40, 12, generator=_gen(seed), dtype=F64)
    R = A.T @ G
    assert torch.allclose(torch.tril(R, -1), torch.zeros_like(R), atol=1e-12)
    assert (torch.diagonal(R) > 0).all()
    A32 = stiefel_random(40, 12, _gen(seed))
    assert A32.dtype == torch.float32 and ortho_error(A32) < 1e-6
    assert torch.equal(A32, A.float())


def test_stiefel_random_rejects_bad_shape():
    with pytest.raises(ValueError):
        stiefel_random(4, 8)


def test_ortho_error():
    assert ortho_error(torch.eye(5, 3, dtype=F64)) == 0.0
    A = torch.eye(5, 3, dtype=F64)
    A[0, 0] = 1.1
    assert ortho_error(A) == pytest.approx(0.21, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_tangent_project_is_orthogonal_projection_onto_tangent_space(seed):
    g = _gen(seed)
    d, r = 30, 7
    A = stiefel_random(d, r, g, dtype=F64)
    G = torch.randn(d, r, generator=g, dtype=F64)
    H = torch.randn(d, r, generator=g, dtype=F64)
    xi = tangent_project(A, G)
    # Tangent space of St(d, r) at A: Aᵀξ is skew-symmetric.
    assert (A.T @ xi + xi.T @ A).abs().max() < 1e-12
    # Idempotent, and tangent vectors are left unchanged.
    assert torch.allclose(tangent_project(A, xi), xi, atol=1e-12)
    # Orthogonal (self-adjoint) w.r.t. the Euclidean inner product: residual ⟂ tangent space.
    assert abs(((G - xi) * tangent_project(A, H)).sum().item()) < 1e-10
    # The normal space {A·S, S symmetric} is annihilated.
    S = sym(torch.randn(r, r, generator=g, dtype=F64))
    assert tangent_project(A, A @ S).abs().max() < 1e-12
    assert torch.equal(sym(S), S)


@pytest.mark.parametrize("seed", SEEDS)
def test_polar_svd(seed):
    g = _gen(seed)
    X = torch.randn(50, 9, generator=g, dtype=F64)
    P = polar_svd(X)
    assert P.shape == X.shape and P.dtype == F64
    assert ortho_error(P) < 1e-13
    # P = X·(XᵀX)^{-1/2}
    evals, evecs = torch.linalg.eigh(X.T @ X)
    ref = X @ (evecs * evals.rsqrt()) @ evecs.T
    assert torch.allclose(P, ref, atol=1e-12)
    # Orthonormal input is a fixed point; wide inputs give orthonormal rows.
    A = stiefel_random(50, 9, g, dtype=F64)
    assert torch.allclose(polar_svd(A), A, atol=1e-13)
    assert (polar_svd(X.T) @ polar_svd(X.T).T - torch.eye(9, dtype=F64)).abs().max() < 1e-13
    # Low-precision input: computed in fp32, returned in the input dtype.
    Pb = polar_svd(X.bfloat16())
    assert Pb.dtype == torch.bfloat16 and ortho_error(Pb) < 2e-2


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (200, 50)])
def test_polar_express_matches_svd_for_well_conditioned(seed, shape):
    """Stated tolerance: for singular values in [0.2, 1] (cond <= 5), 10 steps agree with the exact
    polar factor to 1e-12 in fp64 and 1e-5 in fp32; bf16 compute only to ~5e-2."""
    g = _gen(seed)
    m, n = shape
    k = min(m, n)
    s = torch.linspace(0.2, 1.0, k, dtype=F64)
    X = _matrix_with_singular_values(max(m, n), k, s, g)
    if m < n:
        X = X.T
    ref = polar_svd(X)
    assert (polar_express(X, steps=10) - ref).abs().max() < 1e-12          # fp64 in -> fp64 compute
    P32 = polar_express(X.float(), steps=10)
    assert P32.dtype == torch.float32
    assert (P32.double() - ref).abs().max() < 1e-5
    Pbf = polar_express(X.float(), steps=10, dtype=torch.bfloat16)
    assert Pbf.dtype == torch.float32 and (Pbf.double() - ref).abs().max() < 5e-2
    # Scale invariance (the Frobenius pre-scaling): polar(c·X) = polar(X).
    assert (polar_express(123.0 * X, steps=10) - ref).abs().max() < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
def test_polar_express_near_orthonormal_retraction_accuracy(seed):
    # The retraction case: A - lr·D has singular values near 1 but the Frobenius scaling puts them
    # at ~1/(1.01·sqrt(r)); 8+ fp32 steps must still reach ~1e-6 orthonormality.
    g = _gen(seed)
    A = stiefel_random(256, 64, g)
    Y = A - 0.02 * msign(torch.randn(256, 64, generator=g))
    for steps in (8, 10):
        assert ortho_error(polar_express(Y, steps=steps)) < 2e-6
    assert ortho_error(polar_express(Y, steps=5)) > 1e-4   # why the default is 10, not Muon's 5


def test_msign_dispatch_zero_and_rank_deficient():
    g = _gen(0)
    X = torch.randn(20, 6, generator=g, dtype=F64)
    assert torch.equal(msign(X, "svd"), polar_svd(X))            # full rank: the polar factor
    assert torch.allclose(msign(X, "polar_express", steps=12), polar_svd(X), atol=1e-6)
    with pytest.raises(ValueError):
        msign(X, "newton")
    Z = torch.zeros(20, 6, dtype=F64)
    assert torch.equal(msign(Z, "svd"), Z) and torch.equal(msign(Z, "polar_express"), Z)
    # Rank 1: msign(σ·u·vᵀ) = u·vᵀ, null directions stay 0 (no arbitrary completion).
    u = torch.randn(20, 1, generator=g, dtype=F64)
    v = torch.randn(6, 1, generator=g, dtype=F64)
    R1 = 3.0 * u @ v.T
    uv = (u / u.norm()) @ (v / v.norm()).T
    assert torch.allclose(msign(R1, "svd"), uv, atol=1e-12)
    assert torch.allclose(msign(R1, "polar_express", steps=12), uv, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["svd", "polar_express"])
def test_msign_is_spectral_lmo_of_tangent_momentum(seed, method):
    g = _gen(seed)
    A = stiefel_random(32, 8, g, dtype=F64)
    m = tangent_project(A, torch.randn(32, 8, generator=g, dtype=F64))
    D = msign(m, method, steps=12)
    # ‖D‖₂ = 1 and ⟨m, D⟩ = ‖m‖_* : the steepest-descent direction in spectral norm.
    assert torch.linalg.matrix_norm(D, ord=2).item() == pytest.approx(1.0, abs=1e-6)
    nuc = torch.linalg.matrix_norm(m, ord="nuc").item()
    assert (m * D).sum().item() == pytest.approx(nuc, rel=1e-6)


def test_principal_angles():
    d = 10
    e = torch.eye(d, dtype=F64)
    t1, t2 = math.radians(20.0), math.radians(70.0)
    A = e[:, :2]
    B = torch.stack([math.cos(t2) * e[1] + math.sin(t2) * e[3],
                     math.cos(t1) * e[0] + math.sin(t1) * e[2]], dim=1)
    ang = principal_angles(A, B)
    assert ang.dtype == F64
    assert torch.allclose(ang, torch.tensor([20.0, 70.0], dtype=F64), atol=1e-10)   # sorted
    # Basis-independent: any invertible mix of the columns gives the same angles.
    M = torch.tensor([[2.0, 1.0], [0.5, -3.0]], dtype=F64)
    assert torch.allclose(principal_angles(A @ M, B @ M.T), ang, atol=1e-10)
    # Tiny angles are resolved (sine branch), identical subspaces give ~0.
    tiny = 1e-7
    C = torch.stack([e[0], math.cos(tiny) * e[1] + math.sin(tiny) * e[5]], dim=1)
    assert principal_angles(A, C)[-1].item() == pytest.approx(math.degrees(tiny), rel=1e-6)
    assert principal_angles(A, A @ M).max().item() < 1e-10
    # Different ranks: min(ra, rb) angles.
    assert principal_angles(e[:, :3], e[:, [0]]).shape == (1,)


# ---------------------------------------------------------------------------------------------
# SPEL
# ---------------------------------------------------------------------------------------------

def test_spel_rejects_non_stiefel_shapes_and_bad_hyperparams():
    for shape in [(8,), (4, 8), (2, 3, 4)]:
        with pytest.raises(ValueError, match=r"shape \(" + ", ".join(map(str, shape))):
            SPEL([torch.nn.Parameter(torch.zeros(shape))], lr=0.1)
    ok = torch.nn.Parameter(stiefel_random(8, 4))
    with pytest.raises(ValueError):
        SPEL([ok], polar="qr")
    with pytest.raises(ValueError):
        SPEL([ok], momentum=1.0)
    opt = SPEL([ok], lr=0.1, polar="polar_express", polar_steps=7)
    with pytest.raises(ValueError, match=r"shape \(3, 5\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 5))]})


def _spel_random_walk(seed, dtype, polar, steps=2000, d=32, r=8, **kw):
    g = _gen(seed)
    A = torch.nn.Parameter(stiefel_random(d, r, g, dtype=dtype))
    opt = SPEL([A], lr=0.03, polar=polar, polar_steps=10, **kw)
    worst = 0.0
    for i in range(steps):
        A.grad = torch.randn(d, r, generator=g, dtype=dtype)
        opt.step()
        if i % 100 == 99:
            worst = max(worst, ortho_error(A))
    return A, worst


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype,polar", [(F64, "svd"), (F64, "polar_express"),
                                         (torch.float32, "svd"), (torch.float32, "polar_express")])
def test_spel_stays_on_manifold_over_2000_steps(seed, dtype, polar):
    A, worst = _spel_random_walk(seed, dtype, polar)
    assert A.dtype == dtype
    assert worst <= 1e-5 and ortho_error(A) <= 1e-5
    if dtype == F64:
        assert worst <= 1e-10


def test_spel_without_momentum_stays_on_manifold():
    A, worst = _spel_random_walk(0, torch.float32, "svd", steps=300, momentum=0.0)
    assert worst <= 1e-5


def test_spel_projects_off_manifold_init_and_zero_grad_is_noop():
    g = _gen(0)
    A = torch.nn.Parameter(torch.randn(16, 4, generator=g, dtype=F64))
    opt = SPEL([A], lr=0.01)
    A.grad = torch.zeros_like(A)
    opt.step()
    assert ortho_error(A) < 1e-13                    # first step retracts onto St(d, r)
    A0 = A.detach().clone()
    A.grad = torch.zeros_like(A)
    opt.step()                                       # msign(0) = 0 -> polar(A) = A
    assert torch.allclose(A, A0, atol=1e-14)


def test_spel_skips_params_without_grad():
    g = _gen(0)
    A = torch.nn.Parameter(stiefel_random(16, 4, g))
    B = torch.nn.Parameter(stiefel_random(16, 4, g))
    B0 = B.detach().clone()
    opt = SPEL([A, B], lr=0.05)
    A.grad = torch.randn(16, 4, generator=g)
    opt.step()
    assert torch.equal(B, B0) and B not in opt.state
    assert "momentum_buffer" in opt.state[A]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["svd", "polar_express"])
def test_spel_step_first_order_behaviour(seed, method):
    """polar(A - lr·D) = A - lr·P_T(D) + O(lr²): the step moves along the tangent projection of the
    msign direction, with only an O(lr²) normal component, and decreases ⟨gR, ·⟩ at rate ‖gR‖_*."""
    g = _gen(seed)
    A0 = stiefel_random(32, 8, g, dtype=F64)
    G = torch.randn(32, 8, generator=g, dtype=F64)
    gR = tangent_project(A0, G)
    D = msign(gR, method, steps=12)
    nuc = torch.linalg.matrix_norm(gR, ord="nuc").item()
    residuals = []
    for lr in (1e-2, 5e-3, 2.5e-3):
        A = torch.nn.Parameter(A0.clone())
        opt = SPEL([A], lr=lr, momentum=0.0, polar=method, polar_steps=12)
        A.grad = G.clone()
        opt.step()
        step = A.detach() - A0
        # The optimizer step is exactly polar(A0 - lr·msign(gR)).
        assert torch.allclose(A.detach(), polar_svd(A0 - lr * D), atol=1e-12)
        normal = (A0 @ sym(A0.T @ step)).norm().item()
        assert normal <= 0.6 * lr**2 * D.norm().item() ** 2   # polar retraction: sym(Aᵀ·step) = -½ stepᵀstep
        residuals.append((step + lr * tangent_project(A0, D)).norm().item())
        assert (gR * step).sum().item() == pytest.approx(-lr * nuc, rel=5 * lr)
    # Second order: halving lr quarters the deviation from the tangent step.
    for big, small in zip(residuals, residuals[1:]):
        assert 0.2 < small / big < 0.3


def _pca_problem(seed, n=256, d=32, r=4, noise=0.1):
    g = _gen(seed)
    Ut = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=F64)).Q
    Vt = stiefel_random(d, r, g, dtype=F64)
    s = torch.linspace(10.0, 6.0, r, dtype=F64) * math.sqrt(n)   # clear gap over the noise floor
    X = (Ut * s) @ Vt.T + noise * torch.randn(n, d, generator=g, dtype=F64)
    S = torch.linalg.svdvals(X)
    assert S[r - 1] > 10 * S[r]                                   # the spectral gap is real
    V_pca = torch.linalg.svd(X, full_matrices=False).Vh[:r].T
    return X, V_pca, g


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("polar", ["svd", "polar_express"])
def test_spel_recovers_pca_subspace(seed, polar):
    """Minimising ‖X - X·A·Aᵀ‖² over St(d, r) recovers the top-r right singular subspace."""
    X, V_pca, g = _pca_problem(seed)
    n, d = X.shape
    r = V_pca.shape[1]
    A = torch.nn.Parameter(stiefel_random(d, r, g, dtype=F64))
    assert principal_angles(A, V_pca).max() > 45.0                # starts far away
    steps, lr0, lr1 = 400, 0.05, 1e-4
    opt = SPEL([A], lr=lr0, polar=polar)
    # msign steps have length lr whatever the gradient size, so lr must decay to converge.
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=(lr1 / lr0) ** (1 / steps))
    for _ in range(steps):
        opt.zero_grad()
        loss = ((X - X @ A @ A.T) ** 2).sum() / n
        loss.backward()
        opt.step()
        sched.step()
    assert principal_angles(A, V_pca).max().item() < 1.0
    assert ortho_error(A) < 1e-10
    optimum = (torch.linalg.svdvals(X)[r:] ** 2).sum().item() / n
    assert loss.item() == pytest.approx(optimum, rel=1e-3)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_spel_bf16_gradients_keep_fp32_param_on_manifold(seed):
    g = _gen(seed)
    d, r = 32, 8
    A = torch.nn.Parameter(stiefel_random(d, r, g))
    W = torch.randn(d, d, generator=g)
    X = torch.randn(64, d, generator=g)
    opt = SPEL([A], lr=0.02)
    for _ in range(300):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((X @ A @ A.T - X @ W) ** 2).mean()      # bf16 matmuls inside autocast
        loss.float().backward()
        assert A.grad.dtype == torch.float32
        A.grad = A.grad.bfloat16().float()                  # and bf16-rounded gradient values
        opt.step()
    assert A.dtype == torch.float32 and ortho_error(A) <= 1e-5
    assert opt.state[A]["momentum_buffer"].dtype == torch.float32


def test_spel_bf16_param_retracts_in_fp32():
    g = _gen(0)
    A = torch.nn.Parameter(stiefel_random(32, 8, g).bfloat16())
    opt = SPEL([A], lr=0.02, polar="polar_express")
    for _ in range(200):
        A.grad = torch.randn(32, 8, generator=g).bfloat16()
        opt.step()
    assert A.dtype == torch.bfloat16
    assert opt.state[A]["momentum_buffer"].dtype == torch.float32
    assert ortho_error(A) < 2e-2                            # only bf16 rounding of the final cast
    # A reloaded (bf16-cast by torch's policy) buffer is upcast again on the next step.
    opt2 = SPEL([A], lr=0.02, polar="polar_express")
    opt2.load_state_dict(opt.state_dict())
    A.grad = torch.randn(32, 8, generator=g).bfloat16()
    opt2.step()
    assert opt2.state[A]["momentum_buffer"].dtype == torch.float32


@pytest.mark.parametrize("polar", ["svd", "polar_express"])
def test_spel_state_dict_round_trip(polar):
    d, r, n1, n2 = 24, 6, 15, 20
    grads = [torch.randn(d, r, generator=_gen(10 + i)) for i in range(n1 + n2)]
    init = stiefel_random(d, r, _gen(99))
    kw = dict(lr=0.03, momentum=0.9, polar=polar)

    # Uninterrupted run.
    A = torch.nn.Parameter(init.clone())
    opt = SPEL([A], **kw)
    for gr in grads:
        A.grad = gr.clone()
        opt.step()

    # Interrupted: save after n1 steps (through bytes, as a checkpoint would), resume fresh.
    B = torch.nn.Parameter(init.clone())
    opt_b = SPEL([B], **kw)
    for gr in grads[:n1]:
        B.grad = gr.clone()
        opt_b.step()
    buf = io.BytesIO()
    torch.save({"param": B.detach().clone(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    C = torch.nn.Parameter(ckpt["param"])
    opt_c = SPEL([C], lr=123.0, momentum=0.0, polar="svd")   # hyper-params come from the ckpt
    opt_c.load_state_dict(ckpt["opt"])
    assert opt_c.param_groups[0]["lr"] == kw["lr"]
    assert torch.equal(opt_c.state[C]["momentum_buffer"], opt_b.state[B]["momentum_buffer"])
    for gr in grads[n1:]:
        C.grad = gr.clone()
        opt_c.step()
    assert torch.equal(C.detach(), A.detach())
    assert torch.equal(opt_c.state[C]["momentum_buffer"], opt.state[A]["momentum_buffer"])


def test_spel_closure_returns_loss():
    A = torch.nn.Parameter(stiefel_random(8, 2, _gen(0)))
    opt = SPEL([A], lr=0.01)

    def closure():
        opt.zero_grad()
        loss = (A ** 2).sum() + A[0, 0]
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and A.grad is not None and ortho_error(A) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_orthogonality_holds_over_10k_spel_steps(autocast):
    """Long-run stability (reliability issue): 10,000 SPEL steps on a real objective, fp32 parameter,
    gradients from an fp32 or a bf16-autocast forward; max |AᵀA - I| stays <= 1e-5 throughout."""
    import contextlib
    g = torch.Generator().manual_seed(0)
    d, r = 32, 8
    X = torch.randn(256, d, generator=g) @ torch.randn(d, d, generator=g) * 0.3
    A = torch.nn.Parameter(stiefel_random(d, r, g))
    opt = SPEL([A], lr=0.02, momentum=0.9)
    worst = 0.0
    for step in range(10_000):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            rec = (X @ A) @ A.T
            loss = (X - rec).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 500 == 499:
            worst = max(worst, float(ortho_error(A.detach())))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("polar", ["svd", "polar_express"])
def test_spel_and_toolkit_follow_their_inputs_device(polar, on_meta):
    """Under a meta default device, a tensor made without following its input's device would meet
    the real CPU parameter and fail: the class of bug that only shows on a GPU, caught on CPU."""
    torch.set_default_device(None)
    A = torch.nn.Parameter(stiefel_random(32, 8, 0))
    B = stiefel_random(32, 8, 1)
    opt = SPEL([A], lr=0.05, polar=polar)
    torch.set_default_device("meta")
    for _ in range(3):
        A.grad = torch.ones_like(A)
        opt.step()
    assert A.device.type == "cpu" and ortho_error(A) < 1e-5
    assert principal_angles(A, B).device.type == "cpu"
    assert msign(A.detach(), polar).device.type == "cpu"
    assert stiefel_random(32, 8, 2).device.type == "cpu"


NONCONVERGENT = Path(__file__).parent / "data" / "gesdd-nonconvergent-128x32.pt"


def test_the_retraction_survives_the_matrix_that_stopped_a_run():
    """SPEL's retraction input at step ~2,145 of tiny-P4-mapl-4x-3000steps-s0 (all singular values ~1):
    float32 gesdd did not converge on it with one thread. polar_svd returns its polar factor anyway."""
    X = torch.load(NONCONVERGENT, weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # whether this machine's LAPACK needs the retry varies
            Q = polar_svd(X)
    finally:
        torch.set_num_threads(threads)
    assert Q.dtype == torch.float32 and ortho_error(Q) < 1e-5
    assert (Q - X).abs().max() < 1e-2                            # X is near St(128, 32): its polar factor is near X


def test_thin_svd_retries_in_float64_and_says_so(monkeypatch):
    real = torch.linalg.svd

    def gesdd_fails_in_float32(A, full_matrices=True):
        if A.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real(A, full_matrices=full_matrices)

    X = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    expected = real(X, full_matrices=False)
    monkeypatch.setattr(torch.linalg, "svd", gesdd_fails_in_float32)
    with pytest.warns(RuntimeWarning, match=r"float32 LAPACK SVD of a \(16, 4\) matrix did not converge; retried in float64"):
        U, S, Vh = thin_svd(X)
    assert U.dtype == S.dtype == Vh.dtype == torch.float32
    torch.testing.assert_close(S, expected.S)
    torch.testing.assert_close(U @ torch.diag(S) @ Vh, X, atol=1e-5, rtol=1e-5)
    with pytest.raises(torch.linalg.LinAlgError):                # float64 failing too is not hidden
        monkeypatch.setattr(torch.linalg, "svd", lambda A, full_matrices=True: gesdd_fails_in_float32(A.float()))
        thin_svd(X.double())
