"""Residual VQ on the wire (mapl-rvq): search exactness, bit packing, the receiver's own codebook copy
and its sync protocol, statelessness in eval / dry runs, EMA learning, dead-code revival, and the
straight-through gradient."""
import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mapl.core.compress import ProjectionCompressor
from mapl.core.compress.base import WireTransfer
from mapl.core.compress.bitpack import pack_bits, pack_bits_rows, unpack_bits, unpack_bits_rows
from mapl.core.compress.rvq import OP_EMA, OP_INIT, RVQCompressor, RVQSettings, ResidualVQ
from mapl.core.optim import stiefel_random


@torch.no_grad()
def set_codebooks(q: ResidualVQ, cb: torch.Tensor) -> None:
    """Overwrite the codebooks; keeps the counts, bumps the version."""
    q.codebooks.copy_(cb)
    q.embed_sum.copy_(q.codebooks * q.cluster_size.unsqueeze(-1))
    q.mark_initted()
    q._bump_version()


def FixedProjection(d: int, r: int, seed: int = 0, dtype=torch.float32) -> ProjectionCompressor:
    """The real projection compressor with a fixed orthonormal d x r basis (no learned state)."""
    return ProjectionCompressor(d, stiefel_random(d, r, seed), "fixed").to(dtype)


def make(r=8, d=16, seed=0, **kw):
    kw.setdefault("groups", 2)
    kw.setdefault("rounds", 2)
    kw.setdefault("codebook_size", 16)
    return RVQCompressor(FixedProjection(d, r), RVQSettings(**kw), seed=seed)


def roundtrip(c, z):
    return c.unpack(c.pack(z), z.dtype)


def frozen(c):
    """Training mode (messages sync) with codebooks that do not learn: what the stream must converge on."""
    c.train()
    c.rvq.update = lambda *args, **kwargs: None
    return c


def state(c):
    return {k: v.clone() for k, v in c.state_dict().items() if isinstance(v, torch.Tensor)}


def same_state(a, b, keys=None):
    keys = keys or a.keys()
    return all(torch.equal(a[k], b[k]) for k in keys)


class RecordingMeter:
    def __init__(self):
        self.calls = []

    def add_payload(self, boundary, direction, payload, roles, tokens):
        by = {"data": 0, "sync": 0}
        for t, role in zip(payload, roles):
            by[role] += t.numel() * t.element_size()
        self.calls.append((direction, by, tokens))


# ---- search ---------------------------------------------------------------------------------

def reference_search(x, cb):
    """Loop-based greedy residual search in float64: x (N, dim), cb (G, R, K, ds) -> (N, G, R)."""
    G, R, K, ds = cb.shape
    xs, cbs = x.double().tolist(), cb.double().tolist()
    out = []
    for tok in xs:
        row = []
        for g in range(G):
            res = tok[g * ds:(g + 1) * ds]
            picks = []
            for r in range(R):
                dists = [sum((a - b) ** 2 for a, b in zip(res, c)) for c in cbs[g][r]]
                k = min(range(K), key=lambda j: dists[j])
                picks.append(k)
                res = [a - b for a, b in zip(res, cbs[g][r][k])]
            row.append(picks)
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("tile_bytes", [1, 1 << 24])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_search_equals_bruteforce_residual_search(tile_bytes, dtype):
    q = ResidualVQ(dim=12, groups=3, rounds=3, codebook_size=16, kmeans_init=False, seed=3, tile_bytes=tile_bytes)
    q = q.to(dtype)
    z = torch.randn(5, 7, 12, generator=torch.Generator().manual_seed(0), dtype=dtype)
    idx, resid = q.search(z, return_residual=True)
    assert idx.shape == (5, 7, 3, 3) and idx.dtype == torch.int64
    ref = reference_search(z.reshape(-1, 12), q.codebooks).view(5, 7, 3, 3)
    assert torch.equal(idx, ref)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(q.lookup(idx), z - resid, atol=tol, rtol=0)


@pytest.mark.slow
def test_fused_search_kernel_equals_bruteforce_and_matmul():
    """The GPU's default kernel (torch.compile of one fused distance+argmin), compiled here by
    inductor's CPU backend: the same indices as the float64 reference and as the matmul kernel."""
    g = torch.Generator().manual_seed(5)
    fused = ResidualVQ(dim=12, groups=3, rounds=3, codebook_size=16, kmeans_init=False, seed=3,
                       tile_bytes=16 * 16 * 4 * 3, search_kernel="fused")           # 16-token tiles + a partial one
    z = torch.randn(5, 7, 12, generator=g)
    idx, resid = fused.search(z, return_residual=True)
    assert torch.equal(idx, reference_search(z.reshape(-1, 12), fused.codebooks).view(5, 7, 3, 3))
    torch.testing.assert_close(fused.lookup(idx), z - resid, atol=1e-5, rtol=0)
    matmul = ResidualVQ(dim=12, groups=3, rounds=3, codebook_size=16, kmeans_init=False, seed=3, search_kernel="matmul")
    z = torch.randn(300, 12, generator=g)
    assert torch.equal(fused.search(z), matmul.search(z))


_FUSED_PEAK = """
import re, sys, torch
from pathlib import Path
from mapl.core.compress.rvq.search import residual_search, search_transient_bytes
torch.set_num_threads(1)
G, N, K, ds, R = 32, 4096, 256, 2, 2
status = lambda key: 1024 * int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
g = torch.Generator().manual_seed(0)
x, C = torch.randn(N, G, ds, generator=g), torch.randn(G, R, K, ds, generator=g)
residual_search(x[:100], C, kernel="fused", return_residual=True)      # compile at another token count
Path("/proc/self/clear_refs").write_text("5")                          # reset the peak RSS to the current RSS
base = status("VmRSS")
idx, _ = residual_search(x, C, kernel="fused", return_residual=True)
print(status("VmHWM") - base, search_transient_bytes(N, G, R, K, ds, kernel="fused"), G * N * K * 4)
"""


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
def test_fused_search_transient_memory_is_o_of_tokens_times_groups():
    """The compiled kernel must not write the (G, N, K) distance block (here 128 MiB) that a symbolic
    codeword dimension made inductor materialise: one call's peak RSS growth, in a fresh process,
    stays within the plan's O(G·N) transient (~10 MiB) plus allocator slack."""
    out = subprocess.run([sys.executable, "-c", _FUSED_PEAK], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    grown, planned, block = map(int, out.stdout.split())
    assert planned < block / 8
    assert grown <= planned + (4 << 20), f"peak grew {grown / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"


def test_search_transient_counts_the_matmul_tile_and_not_the_fused_block():
    from mapl.core.compress.rvq.search import search_transient_bytes
    G, N, K, ds, R = 128, 4096, 256, 2, 2
    fused = search_transient_bytes(N, G, R, K, ds, kernel="fused", device="cuda")
    assert fused == search_transient_bytes(N, G, R, K, ds, kernel="auto", device="cuda")
    assert fused < G * N * 128                                           # O(G·N): ~80 bytes per (group, token)
    assert search_transient_bytes(2 * N, G, R, K, ds, kernel="fused") < 2 * fused
    tile = search_transient_bytes(N, G, R, K, ds, kernel="matmul", tile_bytes=64 << 20)
    assert 64 << 20 < tile - fused < (64 << 20) + (8 << 20)              # plus the tile's distance block


def test_search_kernel_and_sync_names_come_from_the_config():
    from mapl.core.compress.rvq import SYNC_STRATEGIES
    from mapl.core.compress.rvq.search import SEARCH_KERNELS
    from mapl.core.config import RVQ_SEARCH_KERNELS, RVQ_SYNC_MODES
    assert tuple(SYNC_STRATEGIES) == RVQ_SYNC_MODES and SEARCH_KERNELS is RVQ_SEARCH_KERNELS
    with pytest.raises(ValueError, match="search_kernel"):
        ResidualVQ(dim=4, search_kernel="gpu")


def test_lookup_sums_rounds_and_concatenates_groups():
    q = ResidualVQ(dim=6, groups=3, rounds=2, codebook_size=4, kmeans_init=False)
    idx = torch.tensor([[[1, 2], [0, 3], [3, 3]]])
    out = q.lookup(idx)
    cb = q.codebooks
    want = torch.cat([cb[g, 0, idx[0, g, 0]] + cb[g, 1, idx[0, g, 1]] for g in range(3)])
    torch.testing.assert_close(out[0], want)
    other = torch.randn_like(cb)
    torch.testing.assert_close(q.lookup(idx, other)[0],
                               torch.cat([other[g, 0, idx[0, g, 0]] + other[g, 1, idx[0, g, 1]] for g in range(3)]))


# ---- bit packing ------------------------------------------------------------------------------

def reference_bytes(vals, bits):
    n = len(vals)
    return sum(v << (i * bits) for i, v in enumerate(vals)).to_bytes((n * bits + 7) // 8, "little")


@pytest.mark.parametrize("K", [16, 256, 4096, 65536])
@pytest.mark.parametrize("count", [1, 7, 1001])
def test_pack_bits_bit_exact(K, count):
    bits = K.bit_length() - 1
    v = torch.randint(0, K, (count,), generator=torch.Generator().manual_seed(count + K))
    data = pack_bits(v, bits)
    assert data.dtype == torch.uint8 and data.shape == (math.ceil(count * bits / 8),)
    assert bytes(data.tolist()) == reference_bytes(v.tolist(), bits)
    assert torch.equal(unpack_bits(data, bits, count), v)


def test_pack_bits_every_width_and_rows():
    g = torch.Generator().manual_seed(0)
    for bits in range(1, 17):
        v = torch.randint(0, 1 << bits, (3, 5, 7), generator=g)     # any shape, odd count
        data = pack_bits(v, bits)
        assert bytes(data.tolist()) == reference_bytes(v.reshape(-1).tolist(), bits)
        assert torch.equal(unpack_bits(data, bits, v.numel()), v.reshape(-1))
        rows = pack_bits_rows(v.reshape(3, 35), bits)
        assert rows.shape == (3, math.ceil(35 * bits / 8))
        assert all(torch.equal(rows[i], pack_bits(v[i], bits)) for i in range(3))
        assert torch.equal(unpack_bits_rows(rows, bits, 35), v.reshape(3, 35))
    assert torch.equal(pack_bits(torch.tensor([1, 255]), 8), torch.tensor([1, 255], dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_bits(torch.tensor([16]), 4)
    with pytest.raises(ValueError):
        pack_bits(torch.tensor([1]), 17)


# ---- receiver copy and sync ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "stream", "mirrored"])
def test_receiver_decodes_with_its_own_copy(mode):
    c = make(sync=mode).eval()
    z = torch.randn(2, 5, 8)
    roundtrip(c, z)                                      # a first message: receiver applies a sync slice
    payload = c.pack(z)
    idx = c.rvq.search(z)
    expected = c.recv.lookup(idx).clone()
    with torch.no_grad():
        c.rvq.codebooks.add_(torch.randn_like(c.rvq.codebooks))   # the sender's codebooks move after the pack
    out = c.unpack(payload, z.dtype)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert not torch.allclose(out, c.rvq.lookup(idx))


@pytest.mark.parametrize("fraction,cycle", [(None, 16), (0.25, 4), (0.3, 4)])
def test_stream_converges_exactly_with_frozen_codebooks(fraction, cycle):
    c = frozen(make(sync="stream", stream_fraction=fraction))
    assert c.sync.cycle == cycle
    set_codebooks(c.rvq, torch.randn_like(c.rvq.codebooks))
    z = torch.randn(2, 4, 8)
    for i in range(cycle):
        s, r = c.codebook_checksums()
        assert s != r
        roundtrip(c, z)
        assert c.staleness() == (0 if i == cycle - 1 else 1)
    s, r = c.codebook_checksums()
    assert s == r and torch.equal(c.rvq.codebooks, c.recv.codebooks)
    assert c.check_sync()["identical"]


@pytest.mark.parametrize("mode", ["stream", "full", "mirrored"])
@pytest.mark.parametrize("T", [6, 5])
def test_bytes_match_declaration(mode, T):
    r, G, R, K = 8, 4, 2, 16
    c = make(r=r, groups=G, rounds=R, codebook_size=K, sync=mode, stream_fraction=0.25 if mode == "stream" else None)
    c.train()
    ds, bits, B = r // G, 4, 3
    declared_sync = {"stream": 24 + G * R * 4 * (4 + 4 * ds), "full": 24 + G * R * K * ds * 4,
                     "mirrored": 24 + G * R * K * ds * 4 + G * R * (K // 16) * (4 + 4 * ds)}[mode]
    # stream: the message carrying the k-means init sends the whole codebook (K - n more codewords)
    one_off = G * R * (K - 4) * (4 + 4 * ds) if mode == "stream" else 0
    assert c.sync_bytes_per_microbatch() == declared_sync
    assert c.one_off_sync_bytes() == one_off
    assert c.wire_bytes_per_token("fwd") == G * R * bits / 8
    assert c.wire_bytes_per_token("bwd") == 2 * r
    meter = RecordingMeter()
    x = torch.randn(B, T, 16, requires_grad=True)
    for _ in range(3):
        y = c.decode(WireTransfer.apply(c.encode(x), c, meter, 0))
        y.sum().backward()
    first = True
    for direction, by, tokens in meter.calls:
        if direction == "fwd":
            assert by["sync"] == declared_sync + (one_off if first else 0)
            first = False
            assert by["data"] == B * math.ceil(T * G * R * bits / 8)
            if T * G * R * bits % 8 == 0:
                assert by["data"] == c.wire_bytes_per_token("fwd") * tokens
        else:
            assert by == {"data": c.wire_bytes_per_token("bwd") * tokens, "sync": 0}
    payload = c.pack(torch.randn(B, T, r))
    spec = c.payload_spec((B, T), "fwd")
    assert [(tuple(t.shape), t.dtype) for t in payload] == [(tuple(s), dt) for s, dt in spec]
    assert len(c.payload_roles("fwd")) == len(payload)
    assert c.diagnostics()["sync_bytes_total"] == 4 * declared_sync + one_off


def test_defaults_halve_mapl_bytes():
    c = RVQCompressor(FixedProjection(256, 64))
    assert (c.rvq.groups, c.rvq.rounds, c.rvq.codebook_size) == (32, 2, 256)
    assert c.wire_bytes_per_token("fwd") == 64                  # r bytes/token vs MAPL's 2r
    assert c.wire_bytes_per_token("bwd") == 128
    assert c.sync.n == 1 and c.sync.cycle == 256
    half = RVQCompressor(FixedProjection(256, 64), RVQSettings(groups=16, rounds=1))
    assert half.wire_bytes_per_token("fwd") == 16   # 8x over bf16 z


def test_mirrored_and_full_stay_bit_identical_while_learning():
    g = torch.Generator().manual_seed(0)
    for mode in ("mirrored", "full"):
        c = make(sync=mode, dead_code_threshold=3.0, decay=0.8).train()
        ops = []
        for _ in range(12):
            z = torch.randn(2, 6, 8, generator=g)
            payload = c.pack(z)
            ops.append(int(payload[1][1]))
            c.unpack(payload, z.dtype)
            s, r = c.codebook_checksums()
            assert s == r
            assert c.check_sync()["staleness"] == 0
        assert ops[0] == OP_INIT and set(ops[1:]) == {OP_EMA}
        if mode == "mirrored":
            assert same_state(c.rvq.state_dict(), c.recv.state_dict(),
                              ["codebooks", "cluster_size", "embed_sum", "version"])


def test_mirrored_detects_a_lost_message():
    c = make(sync="mirrored").train()
    roundtrip(c, torch.randn(2, 6, 8))
    c.pack(torch.randn(2, 6, 8))                         # message lost
    roundtrip(c, torch.randn(2, 6, 8))
    with pytest.raises(RuntimeError, match="version gap"):
        c.check_sync()


def test_stream_staleness_is_bounded_while_learning():
    c = make(sync="stream", stream_fraction=0.25).train()      # n=4, cycle 4
    worst = 0
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        roundtrip(c, torch.randn(2, 6, 8, generator=g))
        worst = max(worst, c.check_sync()["staleness"])
    assert 0 < worst <= 2 * c.sync.cycle - 2
    tight = make(sync="stream", max_staleness=1).train()
    for _ in range(3):
        roundtrip(tight, torch.randn(2, 6, 8, generator=g))
    with pytest.raises(RuntimeError, match="staleness"):
        tight.check_sync()
    assert tight.check_sync(raise_on_error=False)["ok"] is False


# ---- statefulness ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["stream", "full", "mirrored"])
def test_no_codebook_change_in_eval(mode):
    c = make(sync=mode).train()
    roundtrip(c, torch.randn(2, 6, 8))                  # k-means init
    c.eval()
    sender = {k: v for k, v in state(c).items() if k.startswith("rvq.")}
    for _ in range(3):
        roundtrip(c, torch.randn(2, 6, 8))
    assert same_state(sender, state(c), sender.keys())
    c.train()
    roundtrip(c, torch.randn(2, 6, 8))
    assert not same_state(sender, state(c), sender.keys()), "training must change them: the test can fail"


def test_a_malformed_header_is_reported_by_the_next_check():
    """The receiver reads no header on the host: T comes from the codes' length, and a header that
    disagrees is flagged on the device and reported by the next check_sync."""
    c = make().eval()
    payload = c.pack(torch.randn(2, 6, 8))
    assert c.check_sync()["ok"]
    payload[1][2] = 7                                  # T does not match the codes' length
    assert c.unpack(payload, torch.float32).shape == (2, 6, 8)
    with pytest.raises(RuntimeError, match="header disagreed"):
        c.check_sync()
    assert c.check_sync(raise_on_error=False)["bad_header"]


def test_a_sub_byte_layout_reads_its_header_and_refuses_a_bad_one():
    """Under 8 bits per token several T pack into the same row length: the header's T is read (and checked)."""
    c = make(r=1, d=4, groups=1, rounds=1, codebook_size=4).eval()     # 2 bits per token
    payload = c.pack(torch.randn(2, 5, 1))
    assert c.unpack(payload, torch.float32).shape == (2, 5, 1)
    payload[1][2] = 9                                  # 18 bits: 3 bytes, not the codes' 2
    with pytest.raises(ValueError, match="header says T=9"):
        c.unpack(payload, torch.float32)


def test_a_receiver_of_a_wrong_op_is_flagged_under_mirrored_sync():
    """Mirrored sync repeats the sender's update from the op the receiver expects: a header with another op
    (here: evaluation's 'none' arriving at a training receiver) is a desync the check reports."""
    sender = make(sync="mirrored").train()
    receiver = copy.deepcopy(sender)
    receiver.unpack(sender.pack(torch.randn(2, 6, 8)), torch.float32)
    assert receiver.check_sync()["ok"]
    sender.eval()
    receiver.unpack(sender.pack(torch.randn(2, 6, 8)), torch.float32)
    rep = receiver.check_sync(raise_on_error=False)
    assert rep["bad_header"] and rep["desync"] and not rep["ok"]          # the op, and the version gap it made


def test_wire_transfer_forward_is_the_receiver_decode():
    c = make(sync="stream", search_with="sender").train()
    for _ in range(3):
        roundtrip(c, torch.randn(2, 6, 8))
    ref = copy.deepcopy(c)
    z = torch.randn(2, 6, 8)
    out = WireTransfer.apply(z, c, None, 0)
    torch.testing.assert_close(out, ref.recv.lookup(ref.rvq.search(z)), atol=0, rtol=0)


def test_state_dict_roundtrip_is_deterministic():
    g = torch.Generator().manual_seed(2)
    c = make(sync="stream", dead_code_threshold=2.0).train()
    for _ in range(5):
        roundtrip(c, torch.randn(2, 6, 8, generator=g))
    d = make(sync="stream", dead_code_threshold=2.0).train()
    d.load_state_dict(c.state_dict())
    for _ in range(5):
        z = torch.randn(2, 6, 8, generator=g)
        a, b = c.pack(z), d.pack(z)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        c.unpack(a, z.dtype), d.unpack(b, z.dtype)


# ---- learning -------------------------------------------------------------------------------

def clustered(n, g, centers, noise=0.05):
    k = torch.randint(0, centers.shape[0], (n,), generator=g)
    return centers[k] + noise * torch.randn(n, centers.shape[1], generator=g)


def test_ema_update_reduces_quantisation_error_on_clustered_data():
    g = torch.Generator().manual_seed(0)
    centers = 3 * torch.randn(12, 8, generator=g)
    q = ResidualVQ(dim=8, groups=2, rounds=1, codebook_size=16, decay=0.8, kmeans_init=False, seed=1)

    def err():
        x = clustered(512, g, centers)
        _, res = q.search(x, return_residual=True)
        return float(res.pow(2).sum() / x.pow(2).sum())

    first = err()
    for _ in range(40):
        x = clustered(512, g, centers)
        q.update(x, q.search(x))
    assert err() < 0.25 * first

    c = make(r=8, groups=2, rounds=2, codebook_size=16, decay=0.9, search_with="sender").train()
    errs = []
    for _ in range(20):
        c.pack(clustered(512, g, centers).view(4, 128, 8))
        errs.append(c.diagnostics()["rel_mse"])
    assert errs[1] < 0.01 * errs[0]                     # k-means init after the first micro-batch
    assert sum(errs[-5:]) <= 1.2 * sum(errs[1:6])       # EMA does not undo it (batch noise ~10%)


def test_dead_codes_are_revived():
    g = torch.Generator().manual_seed(0)
    q = ResidualVQ(dim=4, groups=1, rounds=1, codebook_size=16, decay=0.8, kmeans_init=False,
                   dead_code_threshold=0.5, seed=2)
    cb = q.codebooks.clone()
    cb[0, 0, 8:] = 100.0                                # far from the data: never assigned
    set_codebooks(q, cb)
    revived_at = None
    for step in range(12):
        x = torch.randn(256, 4, generator=g)
        prev = q.codebooks.clone()
        q.update(x, q.search(x))
        moved = (q.codebooks[0, 0, 8:] - prev[0, 0, 8:]).abs().amax(-1) > 1.0
        if moved.any() and revived_at is None:
            revived_at = step
            k = 8 + moved.nonzero()[:, 0]
            assert torch.all(q.cluster_size[0, 0, k] == q.revive_count)          # EMA state reset
            torch.testing.assert_close(q.embed_sum[0, 0, k], q.codebooks[0, 0, k] * q.revive_count)
            # each revived code is a residual (round-0 target = the token itself) from the batch
            assert all((x - q.codebooks[0, 0, kk]).abs().amax(-1).min() == 0 for kk in k)
    assert revived_at is not None
    assert q.codebooks[0, 0, 8:].abs().max() < 10      # all far codes came back to the data
    off = ResidualVQ(dim=4, groups=1, rounds=1, codebook_size=16, decay=0.8, kmeans_init=False, dead_code_threshold=0.0)
    set_codebooks(off, cb)
    for _ in range(12):
        x = torch.randn(256, 4, generator=g)
        off.update(x, off.search(x))
    assert torch.all(off.codebooks[0, 0, 8:] > 90)              # never revived (Laplace smoothing drifts them a bit)


def _revivals_by_nonzero(q, targets, gen_state):
    """The revival pick and write as they were before they went fixed-shape (nonzero: a host read)."""
    G, R, K, M, dev = q.groups, q.rounds, q.codebook_size, q.max_revive, q.codebooks.device
    q._gen.set_state(gen_state)
    tok = torch.randint(targets.shape[0], (G, R, max(M, 1)), generator=q._gen, device="cpu").to(dev)[..., :M]
    cs = q.cluster_size
    key = torch.where(cs < q.dead_code_threshold, cs, torch.full_like(cs, math.inf))
    if M >= K:
        pos, ok = torch.arange(K).expand(G, R, K), torch.isfinite(key)
    else:
        vals, pos = key.topk(M, dim=-1, largest=False, sorted=True)
        ok = torch.isfinite(vals)
    g, r, m = ok.nonzero(as_tuple=True)
    rval = q.no_revivals()[1]
    rval[g, r, m] = targets[tok[g, r, m], g, r]
    rpos = torch.where(ok, pos, torch.full_like(pos, -1)).to(torch.int32)
    out = {n: getattr(q, n).clone() for n in ("codebooks", "cluster_size", "embed_sum")}
    g, r, m = (rpos >= 0).nonzero(as_tuple=True)
    k = rpos[g, r, m].long()
    out["codebooks"][g, r, k] = rval[g, r, m]
    out["cluster_size"][g, r, k] = q.revive_count
    out["embed_sum"][g, r, k] = rval[g, r, m] * q.revive_count
    return rpos, rval, out


@pytest.mark.parametrize("max_revive", [3, 16])          # topk of the dead codes; every code a candidate
def test_fixed_shape_revivals_equal_the_nonzero_ones_bit_for_bit(max_revive):
    """Revivals without a host read (a fixed-shape gather and a masked scatter) pick and write exactly
    what the nonzero-indexed version did: the cpu profile's numbers must not move."""
    g = torch.Generator().manual_seed(4)
    q = ResidualVQ(dim=6, groups=3, rounds=2, codebook_size=16, kmeans_init=False, dead_code_threshold=1.0,
                   max_revive=max_revive, seed=1)
    q.cluster_size.copy_(torch.rand(3, 2, 16, generator=g) * 2)           # about half the codes dead
    q.cluster_size[0] = 5.0                                                 # group 0: none dead
    targets = torch.randn(40, 3, 2, 2, generator=g)
    state = q._gen.get_state()
    rpos_ref, rval_ref, want = _revivals_by_nonzero(q, targets, state)
    q._gen.set_state(state)
    rpos, rval = q._pick_revivals(targets)
    assert torch.equal(rpos, rpos_ref) and torch.equal(rval, rval_ref)
    assert (rpos[0] < 0).all() and (rpos >= 0).sum() >= 6
    q._apply_revivals(rpos, rval)
    for name, ref in want.items():
        assert torch.equal(getattr(q, name), ref), name


def test_diagnostics_report_usage():
    c = make(dead_code_threshold=1.0).train()
    for _ in range(3):
        roundtrip(c, torch.randn(4, 16, 8))
    d = c.diagnostics()
    for key in ("codebook_perplexity_mean", "dead_code_pct", "staleness", "sync_bytes_total", "rel_mse",
                "codebook_perplexity_per_round", "dead_code_pct_per_round"):
        assert key in d
    assert 1.0 <= d["codebook_perplexity_mean"] <= 16 and 0 <= d["dead_code_pct"] <= 100
    assert len(d["codebook_perplexity_per_round"]) == 2


# ---- gradient -------------------------------------------------------------------------------

def test_straight_through_gradcheck():
    """f(x) = decode(wire(encode(x))): the wire quantises (piecewise constant), so the STE claims
    df/dx = A A^T. F = f - f.detach() + (decode(encode(x))).detach() has F's value = the unquantised
    path (whose finite differences are A A^T) and F's autograd gradient = f's STE backward, so
    gradcheck compares the STE backward with the projection's Jacobian."""
    c = RVQCompressor(FixedProjection(6, 4, dtype=torch.float64), RVQSettings(groups=2, rounds=1, codebook_size=16)).eval()
    c.wire_dtype = torch.float64                    # the gradient leg in float64, as the projections' gradcheck
    roundtrip(c, torch.randn(1, 1, 4))

    def F(x):
        f = c.decode(WireTransfer.apply(c.encode(x), c, None, 0))
        return f - f.detach() + c.decode(c.encode(x)).detach()

    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(F, (x,), eps=1e-6, atol=1e-8)
    # and with the default bf16 gradient wire: the r-wide gradient is rounded to bf16, nothing else
    c16 = RVQCompressor(FixedProjection(6, 4, dtype=torch.float64), RVQSettings(groups=2, rounds=1, codebook_size=16)).train()
    u = torch.randn(2, 3, 6, dtype=torch.float64)
    x.grad = None
    (c16.decode(WireTransfer.apply(c16.encode(x), c16, None, 0)) * u).sum().backward()
    A = c16.inner.A
    torch.testing.assert_close(x.grad, (u @ A).to(torch.bfloat16).double() @ A.T, atol=0, rtol=0)


# ---- validation -----------------------------------------------------------------------------

def test_constructor_validation():
    with pytest.raises(ValueError, match="power of two"):
        ResidualVQ(dim=8, groups=2, rounds=1, codebook_size=100)
    with pytest.raises(ValueError, match=r"dim=10.*groups=4"):
        ResidualVQ(dim=10, groups=4, rounds=1, codebook_size=16)
    with pytest.raises(ValueError, match="sync"):
        make(sync="sometimes")
    with pytest.raises(ValueError, match="stream_fraction"):
        make(stream_fraction=0.0)
    with pytest.raises(ValueError, match="pack expects"):
        make().pack(torch.randn(4, 8))


# ---- two objects = two processes ------------------------------------------------------------

def test_separate_sender_and_receiver_objects_converge_when_frozen():
    sender = make(sync="stream", stream_fraction=0.25).train()
    receiver = copy.deepcopy(sender)                     # same config and seed: identical at version 0
    frozen(sender)
    set_codebooks(sender.rvq, torch.randn_like(sender.rvq.codebooks))
    z = torch.randn(2, 4, 8)
    for _ in range(sender.sync.cycle):
        receiver.unpack(sender.pack(z), z.dtype)
    assert torch.equal(receiver.recv.codebooks, sender.rvq.codebooks)
    assert receiver.staleness() == 0


@pytest.mark.parametrize("mode", ["stream", "full", "mirrored"])
def test_evaluation_messages_do_not_change_training(mode):
    """An evaluation message decodes with the receiver copy and syncs nothing (its sync tensors keep
    their static shapes), so whether and how often a run evaluates cannot change its training: the
    stream's cursor, the receiver copy and every later training message are as without it."""
    torch.manual_seed(0)
    zs = [torch.randn(2, 4, 8) * (1 + i) for i in range(6)]
    runs = []
    for evaluate in (False, True):
        sender = make(sync=mode).train()
        receiver = copy.deepcopy(sender)
        outs = []
        for i, z in enumerate(zs):
            if evaluate and i in (2, 4):
                sender.eval(), receiver.eval()
                payload = sender.pack(torch.randn(3, 5, 8) * 4)
                assert shapes(payload) == [(tuple(s), dt) for s, dt in receiver.payload_spec((3, 5), "fwd")]
                assert receiver.unpack(payload, z.dtype).shape == (3, 5, 8)
                sender.train(), receiver.train()
            outs.append(receiver.unpack(sender.pack(z), z.dtype))
        runs.append((outs, state(sender), state(receiver)))
    (plain, s0, r0), (evaluated, s1, r1) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, evaluated))
    assert same_state(s0, s1) and same_state(r0, r1)


def shapes(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


def test_stream_receiver_gets_the_kmeans_init_at_once():
    """The init moves every codeword: its message carries the whole codebook (a one-off), so the
    receiver does not decode with pre-init codewords for a whole stream cycle. A separate receiver
    object (another process) allocates that message from its own state."""
    sender = make(sync="stream", search_with="sender").train()
    receiver = copy.deepcopy(sender)
    z = torch.randn(2, 6, 8)
    spec = receiver.payload_spec((2, 6), "fwd")
    payload = sender.pack(z)
    assert int(payload[1][1]) == OP_INIT and shapes(payload) == [(tuple(s), dt) for s, dt in spec]
    receiver.unpack(payload, z.dtype)
    assert torch.equal(receiver.recv.codebooks, sender.rvq.codebooks) and receiver.staleness() == 0
    after = receiver.payload_spec((2, 6), "fwd")
    assert after == sender.payload_spec((2, 6), "fwd") and after != spec
    payload = sender.pack(z)
    assert int(payload[1][1]) == OP_EMA and shapes(payload) == [(tuple(s), dt) for s, dt in after]
    receiver.unpack(payload, z.dtype)
    assert receiver.eval().payload_spec((2, 6), "fwd") == after


@pytest.mark.parametrize("one_object", [False, True])
def test_search_with_receiver_keeps_encoder_and_decoder_codebooks_identical(one_object):
    g = torch.Generator().manual_seed(3)
    sender = make(sync="stream", search_with="receiver", dead_code_threshold=2.0).train()
    receiver = sender if one_object else copy.deepcopy(sender)
    for _ in range(12):
        z = torch.randn(2, 6, 8, generator=g)
        payload = sender.pack(z)
        shadow = sender.recv.codebooks.clone()           # what the sender searched
        assert torch.equal(shadow, receiver.recv.codebooks)
        out = receiver.unpack(payload, z.dtype)
        idx = unpack_bits_rows(payload[0], 4, 6 * 2 * 2).view(2, 6, 2, 2)
        assert torch.equal(out, sender.rvq.lookup(idx, shadow))
        rel = float((out - z).pow(2).sum() / z.pow(2).sum())
        assert rel == pytest.approx(sender.diagnostics()["rel_mse"], rel=1e-4)
    assert not torch.equal(sender.rvq.codebooks, sender.recv.codebooks)     # learning runs ahead of the stream
    assert make(sync="mirrored", search_with="receiver").search_with == "sender"   # the same thing there


# ---- the CPU's fused search and encode (mapl/core/compress/rvq/native.py): today's bits ------------------

def _native_or_skip():
    from mapl.core.compress.rvq import native
    if not native.native_enabled() or native._lib() is None:
        pytest.skip("no C compiler for the fused CPU kernel (the matmul kernel runs instead)")
    return native


@torch.no_grad()
def frozen_matmul_search_and_sums(x, C):
    """The matmul path as it was before the fused kernel (search.py and ResidualVQ._targets/update, frozen here):
    per round, one bmm of [res, 1] with [-2c; ||c||^2], the first minimum by amin/le/mul/amax, the codeword
    subtracted; then the EMA sums and counts by index_add_. x (N, G, ds), C (G, R, K, ds)."""
    N, G, ds = x.shape
    R, K = C.shape[1], C.shape[2]
    res = x.transpose(0, 1).clone()                                         # (G, N, ds)
    ones = torch.ones(G, N, 1, dtype=x.dtype)
    rev = torch.arange(K, 0, -1, dtype=x.dtype)
    idx = torch.empty(N, G, R, dtype=torch.int64)
    targets = torch.empty(N, G, R, ds, dtype=x.dtype)
    for r in range(R):
        c = C[:, r].contiguous()
        Ca = torch.cat([-2.0 * c.transpose(1, 2), (c * c).sum(-1).unsqueeze(1)], 1)
        d = torch.bmm(torch.cat([res, ones], -1), Ca)                       # (G, N, K)
        d.le_(d.amin(-1, keepdim=True)).mul_(rev)
        i = (K - d.amax(-1).to(torch.int64)).clamp_(0, K - 1)                # (G, N)
        idx[:, :, r] = i.T
        targets[:, :, r] = res.transpose(0, 1)
        res -= c.reshape(G * K, ds).index_select(0, (i + torch.arange(G)[:, None] * K).view(-1)).view(res.shape)
    flat = (idx + (torch.arange(G)[:, None] * R + torch.arange(R)) * K).reshape(-1)
    sums = torch.zeros(G * R * K, ds, dtype=x.dtype).index_add_(0, flat, targets.reshape(-1, ds))
    counts = torch.zeros(G * R * K, dtype=torch.int64).index_add_(0, flat, torch.ones_like(flat))
    return idx, res.transpose(0, 1), targets, sums.view(G, R, K, ds), counts.view(G, R, K)


@pytest.mark.parametrize("G,R,K,ds", [(32, 2, 256, 2), (3, 3, 16, 4), (4, 2, 8, 2), (5, 2, 32, 3), (2, 1, 64, 8),
                                      (6, 2, 64, 1), (2, 2, 4096, 2)])
def test_fused_cpu_search_gives_the_matmul_bits(G, R, K, ds):
    """Indices, final residuals, round targets, sums and counts bit for bit, with exact ties (equal codewords,
    tokens on codewords), scales from 1e-3 to 1e3, a NaN token and an infinite one."""
    native = _native_or_skip()
    g = torch.Generator().manual_seed(G * K + ds)
    N = 300
    C = torch.randn(G, R, K, ds, generator=g) * (0.5 ** torch.arange(R, dtype=torch.float32)).view(1, R, 1, 1)
    C[:, :, 1::5] = C[:, :, 0:1]
    x = torch.randn(N, G, ds, generator=g) * 10.0 ** torch.randint(-3, 4, (N, 1, 1), generator=g).float()
    x[:min(N, K)] = C[:, 0, :min(N, K)].transpose(0, 1)
    x[7, 0, 0], x[8, G - 1, ds - 1] = float("nan"), float("inf")
    want = frozen_matmul_search_and_sums(x, C)
    idx, resid, (targets, sums, counts) = native.native_search(x, C, return_residual=True, return_stats=True)
    for a, b in zip((idx, resid, targets, sums, counts), want):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
    x = x.nan_to_num(0.0, 0.0, 0.0)
    assert native.native_available(x, C)            # the layout's own check against the matmul kernel passes


@pytest.mark.parametrize("kw", [dict(), dict(sync="mirrored", dead_code_threshold=3.0, decay=0.8),
                                dict(sync="full", scale="token"), dict(groups=4, rounds=3, codebook_size=32),
                                dict(groups=1, rounds=2, codebook_size=256, search_with="sender")])
def test_fused_cpu_pack_is_bit_identical_to_the_matmul_pack(kw, monkeypatch):
    """Consecutive training messages (the EMA state evolving, dead codes revived), then an evaluation message:
    the same payload bytes, decoded values and codebook state (sender and receiver) as the matmul kernel's pack,
    which computes its round targets, sums and counts itself (the code path of every committed run)."""
    native = _native_or_skip()
    from mapl.core.compress.rvq import codebook
    used = []
    monkeypatch.setattr(codebook, "native_search", lambda *a, **k: used.append(k["return_stats"]) or
                        native.native_search(*a, **k))
    fused, matmul = make(**kw), make(search_kernel="matmul", **kw)
    g = torch.Generator().manual_seed(11)
    for step in range(6):
        training = step < 5
        fused.train(training), matmul.train(training)
        z = torch.randn(3, 10, 8, generator=g) * (1.0 + step)
        pf, pm = fused.pack(z.clone()), matmul.pack(z.clone())     # (k-means with G = 1 writes into z)
        assert len(pf) == len(pm) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(pf, pm))
        assert torch.equal(fused.unpack(pf, z.dtype), matmul.unpack(pm, z.dtype))
        assert same_state(state(fused), state(matmul))
    # every message searched by the fused kernel; the EMA steps (not the k-means init, not eval) took its sums
    assert used == [False, True, True, True, True, False]
    assert fused.rvq.host_version == 5 and fused.diagnostics()["microbatches"] == 6
