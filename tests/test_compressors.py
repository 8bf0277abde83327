"""Boundary compressors: exactness where promised, error bands where lossy, bytes as declared,
gradients as autograd says."""

import pytest
import torch

from mapl.core.compress import Compressor, Int8Compressor, ProjectionCompressor, WireTransfer, build_boundary, payload_bytes
from mapl.core.compress.anchors import Anchor
from mapl.core.compress.ssn import SubspaceLinear
from mapl.core.optim import stiefel_random
from mapl.core.config import AnchorConfig, CompressorConfig, RVQConfig, RunConfig, TrainConfig
from mapl.core.stages import build_staged_model
from mapl.core.engine import build_optimizers
from mapl.core.wire import ByteMeter

D, V = 64, 256


def micro_cfg(method, ratio=4.0, stages=2, **comp):
    return RunConfig(profile="micro", model="micro", stages=stages,
                     compressor=CompressorConfig(method=method, ratio=ratio, **comp),
                     train=TrainConfig(steps=10, batch_size=4, seq_len=32, micro_batches=2, warmup_steps=1))


def _train_a_few_steps(sm, cfg, steps=5, seed=0):
    opts = build_optimizers(sm, cfg)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, V, (4, 32), generator=g)
        loss = sm(ids[:, :-1], ids[:, 1:])
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return sm


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_ssn_is_lossless_at_every_boundary_during_training(stages):
    cfg = micro_cfg("ssn", ratio=4, stages=stages)
    sm = build_staged_model(cfg, V)
    for c in sm.compressors():
        c.wire_dtype = torch.float32        # isolate SSN's exactness from the bf16 wire
    _train_a_few_steps(sm, cfg)
    ids = torch.randint(0, V, (2, 32))
    x = None
    with torch.no_grad():
        for s in range(stages - 1):
            h = sm.boundary_input(s, x, ids)            # the residual minus the static shift
            comp = sm.boundaries[str(s)]
            rt = comp.decode(comp.encode(h))
            assert torch.allclose(rt, h, atol=1e-5 * h.abs().max().item()), f"boundary {s} not exact"
            x = WireTransfer.apply(sm.stage_forward(s, x, ids), comp, None, s)


def test_mapl_round_trip_is_lossy_so_the_ssn_test_can_fail():
    cfg = micro_cfg("mapl", ratio=4)
    sm = build_staged_model(cfg, V)
    ids = torch.randint(0, V, (2, 32))
    with torch.no_grad():
        h = sm.boundary_input(0, None, ids)
        comp = sm.boundaries["0"]
        err = (comp.decode(comp.encode(h)) - h).norm() / h.norm()
    assert err > 0.1


def test_ssn_residual_writers_live_in_span_U():
    U = stiefel_random(D, 16, 3)
    lin = SubspaceLinear(torch.randn(D, 32), U)
    y = lin(torch.randn(5, 32))
    assert torch.allclose(y @ U @ U.T, y, atol=1e-5)


@pytest.mark.parametrize("method,ratio,fwd,bwd", [
    ("none", 1, 2 * D, 2 * D), ("int8", 1, D + 2, D + 2), ("ssn", 4, 2 * 16, 2 * 16), ("mapl", 8, 2 * 8, 2 * 8)])
def test_declared_bytes_per_token_follow_the_formula(method, ratio, fwd, bwd):
    comp = build_boundary(CompressorConfig(method=method, ratio=ratio).validate(D), D, 0)
    assert comp.wire_bytes_per_token("fwd") == fwd
    assert comp.wire_bytes_per_token("bwd") == bwd
    z = comp.encode(torch.randn(3, 7, D))
    assert payload_bytes(comp.pack(z)) == fwd * 21
    assert payload_bytes(comp.pack_grad(torch.randn_like(z))) == bwd * 21


@pytest.mark.parametrize("block", [0, 16])
def test_int8_error_is_small_but_nonzero_on_both_legs(block):
    comp = Int8Compressor(D, block)
    x = torch.randn(4, 8, D, requires_grad=True)
    meter = ByteMeter()
    y = WireTransfer.apply(x, comp, meter, 0)
    err = (y - x).norm() / x.norm()
    assert 1e-4 < err < 1e-2, "int8 must change the values (compression used) but only slightly"
    g = torch.randn_like(y)
    y.backward(g)
    gerr = (x.grad - g).norm() / g.norm()
    assert 1e-4 < gerr < 1e-2
    assert meter.total("data", "fwd") == 32 * comp.wire_bytes_per_token("fwd")
    assert meter.total("data", "bwd") == 32 * comp.wire_bytes_per_token("bwd")


def test_int8_zero_rows_survive():
    comp = Int8Compressor(D)
    z = torch.zeros(2, 3, D)
    assert torch.equal(comp.unpack(comp.pack(z), torch.float32), z)


@pytest.mark.slow
@pytest.mark.parametrize("receiver_grad", ["exact", "drop"])
def test_wire_transfer_and_projection_gradcheck_float64(receiver_grad):
    A = torch.linalg.qr(torch.randn(D, 16, dtype=torch.float64))[0]
    comp = ProjectionCompressor(D, A, "spel", receiver_grad).double()
    comp.wire_dtype = torch.float64
    x = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)

    def f(x, A_):
        comp.A.data.copy_(A_)
        return comp.decode(WireTransfer.apply(comp.encode(x), comp, None, 0))
    assert torch.autograd.gradcheck(lambda x: f(x, A), (x,))
    # the projector's gradient: both the sender term and (exact mode) the receiver term
    Ap = A.clone().requires_grad_(True)
    comp2 = ProjectionCompressor(D, A, "spel", receiver_grad).double()
    comp2.wire_dtype = torch.float64
    comp2.A = torch.nn.Parameter(Ap.detach().clone())
    out = comp2.decode(WireTransfer.apply(comp2.encode(x.detach()), comp2, None, 0))
    G = torch.randn_like(out)
    (out * G).sum().backward()
    comp2.fold_receiver_grad()                      # the receiver term is kept apart until the step ends
    X = x.detach().reshape(-1, D)
    Gf = G.reshape(-1, D)
    sender = X.T @ (Gf @ A)                         # d(loss)/dA via Z = X A
    receiver = Gf.T @ (X @ A)                        # d(loss)/dA via X_hat = Z Aᵀ
    expect = sender + receiver if receiver_grad == "exact" else sender
    assert torch.allclose(comp2.A.grad, expect, atol=1e-10)


@pytest.mark.parametrize("kind", ["none", "static", "full", "factorized"])
def test_anchor_shapes_and_factorized_rank(kind):
    a = Anchor(kind, V, D, 8, seed=1, init_std=0.1)
    out = a(torch.arange(V))
    if kind == "none":
        assert out is None
        return
    assert out.shape == (V, D)
    rank = torch.linalg.matrix_rank(out.double(), rtol=1e-5).item()
    assert rank == (8 if kind == "factorized" else D)


def test_none_wire_is_bf16_rounding_only():
    comp = Compressor(D)
    x = torch.randn(3, D)
    y = comp.unpack(comp.pack(x), torch.float32)
    assert torch.equal(y, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("bad,field", [(dict(method="mapl", ratio=3), "ratio"), (dict(method="mapl", ratio=1), "ratio"),
                                       (dict(method="zip"), "method"),
                                       (dict(method="mapl", ratio=4, anchor=AnchorConfig(kind="big")), "anchor"),
                                       (dict(method="mapl-rvq", ratio=4, rvq=RVQConfig(codebook_size=100)), "rvq.codebook_size"),
                                       (dict(method="mapl-rvq", ratio=4, rvq=RVQConfig(groups=5)), "rvq.groups")])
def test_bad_compressor_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        CompressorConfig(**bad).validate(D)


# ---- device-correctness: every tensor made inside follows its input's device -----------------------



@pytest.mark.parametrize("method,sync", [("none", "stream"), ("int8", "stream"), ("ssn", "stream"), ("mapl", "stream"),
                                         ("mapl-rvq", "stream"), ("mapl-rvq", "full"), ("mapl-rvq", "mirrored")])
def test_compressors_follow_their_inputs_device(method, sync, on_meta):
    torch.set_default_device(None)
    cfg = CompressorConfig(method=method, ratio=1.0 if method in ("none", "int8") else 4.0, rvq=RVQConfig(sync=sync))
    comp = build_boundary(cfg.validate(D), D, 0).train()
    x = torch.randn(2, 40, D, requires_grad=True)
    torch.set_default_device("meta")
    meter = ByteMeter()
    for _ in range(3):                                   # RVQ: k-means init, EMA steps, revivals
        y = comp.decode(WireTransfer.apply(comp.encode(x), comp, meter, 0))
        y.backward(torch.ones_like(y))
        assert y.device.type == "cpu" and x.grad.device.type == "cpu"
    comp.fold_receiver_grad()
    comp.eval()
    z = comp.encode(x.detach())
    assert comp.unpack(comp.pack(z), z.dtype).device.type == "cpu"
    comp.diagnostics(), comp.check_sync(), comp.checksum()
    comp.apply_sync(comp.sync_payload())


def test_seed_table_reproduces_the_offsets_the_results_were_made_with():
    from mapl.core.seeds import derive_seed
    assert [derive_seed(1234, p, i) for p, i in [("shared_basis", 0), ("static_shift", 0), ("projector", 2),
                                                  ("rvq", 1), ("anchor", 3), ("rvq_stream", 0)]] == \
        [1234, 1241, 1336, 1435, 2237, 9153]
    with pytest.raises(ValueError, match="purpose"):
        derive_seed(0, "projecter")
    with pytest.raises(ValueError, match="index"):
        derive_seed(0, "projector", 100)
    # the projector of boundary 1: QR of a float64 Gaussian drawn from seed + 100 + 1, columns sign-fixed
    comp = build_boundary(CompressorConfig(method="mapl", ratio=4).validate(D), D, 1)
    q, r = torch.linalg.qr(torch.randn(D, 16, generator=torch.Generator().manual_seed(1234 + 101), dtype=torch.float64))
    assert torch.equal(comp.basis().detach(), (q * torch.sign(torch.diagonal(r))).float())


# ---- the int8 backward message (compressor.grad_wire) ----------------------------------------------------------
@pytest.mark.parametrize("method", ["ssn", "mapl", "mapl-rvq"])
def test_an_int8_backward_message_is_declared_metered_and_close(method):
    """grad_wire=int8: r codes and one fp16 scale per token on the backward leg (r + 2 bytes, not 2r), the
    declared spec is what pack_grad sends, the forward leg is untouched, and the gradient that arrives is
    the int8 round trip of the one sent (small but nonzero error)."""
    same = build_boundary(CompressorConfig(method=method, ratio=8).validate(D), D, 0).train()
    comp = build_boundary(CompressorConfig(method=method, ratio=8, grad_wire="int8").validate(D), D, 0).train()
    r = D // 8
    assert comp.wire_bytes_per_token("bwd") == r + 2 and same.wire_bytes_per_token("bwd") == 2 * r
    assert comp.wire_bytes_per_token("fwd") == same.wire_bytes_per_token("fwd")
    assert comp.wire_efficiency_floor("bwd") == 8 * r + 16
    g = torch.randn(3, 7, r)
    payload = comp.pack_grad(g)
    assert [(tuple(t.shape), t.dtype) for t in payload] == [(s, dt) for s, dt in comp.payload_spec((3, 7), "bwd")]
    assert payload_bytes(payload) == (r + 2) * 21 and comp.payload_roles("bwd") == ["data", "data"]
    back = comp.unpack_grad(payload, torch.float32)
    err = (back - g).norm() / g.norm()
    assert 1e-4 < err < 1e-2
    assert torch.equal(same.unpack_grad(same.pack_grad(g), torch.float32), g.to(torch.bfloat16).float())


def test_an_int8_backward_message_through_the_wire_transfer():
    comp = build_boundary(CompressorConfig(method="mapl", ratio=8, grad_wire="int8").validate(D), D, 0)
    z = torch.randn(4, 8, D // 8, requires_grad=True)
    meter = ByteMeter()
    y = WireTransfer.apply(z, comp, meter, 0)
    g = torch.randn_like(y)
    y.backward(g)
    assert 1e-4 < (z.grad - g).norm() / g.norm() < 1e-2
    assert meter.total("data", "bwd") == 32 * comp.wire_bytes_per_token("bwd") == 32 * (D // 8 + 2)


@pytest.mark.parametrize("method", ["none", "int8"])
def test_an_int8_backward_message_needs_a_projection(method):
    with pytest.raises(ValueError, match="compressor.grad_wire"):
        CompressorConfig(method=method, grad_wire="int8").validate(D)
    with pytest.raises(ValueError, match="grad_wire"):
        CompressorConfig(method="mapl", ratio=8, grad_wire="fp8").validate(D)
