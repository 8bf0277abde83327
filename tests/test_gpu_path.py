"""CPU proofs of what the GPU path needs from the runtime: the communication timeout is a
validated setting (minutes in the paper profile), the compiled RVQ search is warmed before the first
timed wait, P x R beyond the local GPUs is refused, TF32 stays off inside SPEL, the wire never reads
the host per message (mapl-rvq's receiver included), timings come from the device where it has clocks."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from host_reads import counting_host_reads
from mapl.core.config import ConfigError, config_hash, load_run_config
from mapl.core.runtime.topology import Topology
from test_memory import _saved_bytes


# ---- the communication timeout --------------------------------------------------------------------
def test_comm_timeout_is_a_setting_outside_the_hash_with_minutes_in_the_paper_profile():
    cfg = load_run_config("micro")
    assert cfg.train.comm_timeout_s == 60.0
    longer = load_run_config("micro", {"train.comm_timeout_s": "900"})
    assert longer.train.comm_timeout_s == 900.0 and config_hash(longer) == config_hash(cfg)
    assert load_run_config("paper").train.comm_timeout_s >= 300            # NCCL's default is 10 minutes
    for bad, why in (("0", "must be > 0"), ("nan", "finite"), ("soon", "must be a number")):
        with pytest.raises(ConfigError, match=rf"train\.comm_timeout_s=.*{why}"):
            load_run_config("micro", {"train.comm_timeout_s": bad}).validate()


def test_the_timeout_flag_and_its_env_variable_set_the_config_field(monkeypatch):
    from mapl.cli import pipeline, train
    extra, args, _ = pipeline._parse(["--profile", "micro", "--timeout", "120"])
    assert train.config_from_args(args).train.comm_timeout_s == 120.0
    monkeypatch.setenv("MAPL_PG_TIMEOUT", "45")
    extra, args, _ = pipeline._parse(["--profile", "micro"])
    assert train.config_from_args(args).train.comm_timeout_s == 45.0
    monkeypatch.delenv("MAPL_PG_TIMEOUT")
    extra, args, _ = pipeline._parse(["--profile", "paper"])
    assert train.config_from_args(args).train.comm_timeout_s == 600.0       # the profile's, not 60


# ---- the compiled RVQ search is warmed before any timed wait ---------------------------------------
@pytest.mark.slow
def test_the_fused_search_is_compiled_before_training_and_the_first_pack_reuses_it():
    from torch._dynamo.utils import counters

    from mapl.core.compress import build_boundary
    from mapl.core.runtime.rank import warm_compiled_kernels
    cfg = load_run_config("micro", {"method": "mapl-rvq", "ratio": 4, "stages": 2,
                                    "compressor.rvq.search_kernel": "fused"}).validate()
    cpu = torch.device("cpu")
    torch._dynamo.reset()
    counters.clear()
    said = []
    assert warm_compiled_kernels(cfg, Topology(0, 2, 2, cpu), said.append)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1 and "compiled the RVQ search kernel" in said[0]
    d = cfg.model_config().d_model
    comp = build_boundary(cfg.compressor.validate(d), d, 0).train()
    t = cfg.train
    z = torch.randn(t.batch_size // t.micro_batches, t.seq_len, comp.code_dim)
    comp.pack(z)                                        # k-means init, then a search
    comp.pack(z)
    assert counters["stats"]["unique_graphs"] == compiled   # nothing compiled inside a step
    # the receiving (last) stage does not search, and no other method compiles anything
    assert not warm_compiled_kernels(cfg, Topology(1, 2, 2, cpu), said.append)
    mapl = load_run_config("micro", {"method": "mapl", "ratio": 4, "stages": 2}).validate()
    assert not warm_compiled_kernels(mapl, Topology(0, 2, 2, cpu), said.append)
    auto = load_run_config("micro", {"method": "mapl-rvq", "ratio": 4, "stages": 2}).validate()
    assert not warm_compiled_kernels(auto, Topology(0, 2, 2, cpu), said.append)   # auto is matmul on a CPU


def test_a_rank_warms_the_kernel_before_opening_data_or_any_timed_communication(monkeypatch):
    """run_rank's order: the compile (untimed for the neighbours: they wait in the setup group) comes
    before the data, the process groups with the communication timeout, and the first message."""
    from mapl.core.runtime import rank

    class Stop(Exception):
        pass
    order = []
    monkeypatch.setattr(rank, "warm_compiled_kernels", lambda cfg, topo, log: order.append("warm"))
    monkeypatch.setattr(rank, "open_data", lambda *a, **k: order.append("data"))
    monkeypatch.setattr(Topology, "make_groups", lambda self, timeout: order.append("timed groups") or (None, None))

    def transport(*a, **k):
        order.append("transport")
        raise Stop
    monkeypatch.setattr(rank, "Transport", transport)
    cfg = load_run_config("micro", {"method": "mapl-rvq", "ratio": 4, "stages": 2}).validate()
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Stop):
            rank.run_rank(cfg, Topology(0, 2, 2, torch.device("cpu")), out=None, ckpt=None, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert order == ["warm", "data", "timed groups", "transport"]


# ---- one GPU per stage process ------------------------------------------------------------------------
def _gpus(monkeypatch, n: int) -> None:
    """This process sees ``n`` CUDA devices (the functions that decide read only these two)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)


def test_more_stage_processes_than_local_gpus_is_refused_in_one_line(monkeypatch):
    from mapl.core.runtime.topology import check_local_gpus
    _gpus(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")             # what torchrun/accelerate tell each rank
    with pytest.raises(ValueError) as e:
        check_local_gpus()
    assert "\n" not in str(e.value) and "8 stage processes on this machine but 4 GPU(s)" in str(e.value)
    with pytest.raises(ValueError, match="must be <= 4"):
        check_local_gpus(5)                                 # the count a self-launch is about to start
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_local_gpus()                                      # one GPU each: fine
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    check_local_gpus()                                      # per-machine count unknown: not refused
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    check_local_gpus(8)                                     # a CPU run on a GPU machine: gloo, no GPUs used


def test_the_pipeline_refuses_before_starting_ranks_on_too_few_gpus(monkeypatch, tmp_path, capsys):
    from mapl.cli import pipeline
    from mapl.orchestration import pipeline_launch
    _gpus(monkeypatch, 4)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    started = []
    monkeypatch.setattr(pipeline_launch, "launch", lambda *a, **k: started.append(a))
    code = pipeline.main(["--profile", "micro", "--stages", "4", "--replicas", "2",
                          "--out", str(tmp_path / "r.json"), "--ckpt", str(tmp_path / "r.pt")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not started and "\n" not in err
    assert err.startswith("error: 8 stage processes on this machine but 4 GPU(s)")
    assert not list(tmp_path.iterdir())


# ---- host reads per micro-batch: none for any wire ---------------------------------------------------
# The counter (tests/host_reads.py) sees scalar reads (item, int/float/bool of a tensor, indexing with
# a 0-d tensor), data-dependent output shapes, bincount (CUDA's reads min and max), and tolist/numpy, which
# read a CPU tensor without dispatching an op.
def test_the_host_read_counter_sees_every_kind_of_read():
    t = torch.arange(6.0)
    with counting_host_reads() as c:
        int(t[2]), float(t.sum()), bool(t[1] > 0), t[t[3].long().view(())]
        t.nonzero(), torch.bincount(t.long(), minlength=8), t.tolist(), t[t > 2]
        t.mul(2).amax()                                          # device-side work reads nothing
    assert c.counts == {"_local_scalar_dense": 3, "__bool__": 1, "nonzero": 1, "bincount": 1, "tolist": 1,
                        "index[bool mask]": 1}


def _boundary_micro_batch(comp, x: torch.Tensor) -> None:
    """What one micro-batch does at a boundary, sender and receiver: the receive buffer's spec, health,
    pack, unpack (WireTransfer), and the gradient's pack and unpack."""
    from mapl.core.compress import WireTransfer
    comp.payload_spec(tuple(x.shape[:2]), "fwd")
    z = comp.encode(x)
    y = comp.decode(WireTransfer.apply(z, comp, None, 0))
    if torch.is_grad_enabled():
        y.backward(torch.ones_like(y))


@pytest.mark.parametrize("method,rvq", [("none", {}), ("int8", {}), ("ssn", {}), ("mapl", {}),
                                        ("mapl-rvq", {}), ("mapl-rvq", {"scale": "token"}),
                                        ("mapl-rvq", {"sync": "full"}), ("mapl-rvq", {"sync": "mirrored"})])
def test_no_wire_reads_the_host_per_micro_batch(method, rvq):
    """On a GPU a host read waits for the stream: no method's wire reads the host, mapl-rvq's receiver
    included (it no longer reads the 3-value header: T from the codes, the op it expects, the version applied
    on the device), in training (the k-means init message, EMA steps with revivals) and in evaluation; the
    version bookkeeping still follows the sender's."""
    from mapl.core.compress import build_boundary
    from mapl.core.config import CompressorConfig, RVQConfig
    D = 32
    cfg = CompressorConfig(method=method, ratio=1.0 if method in ("none", "int8") else 4.0, rvq=RVQConfig(**rvq))
    comp = build_boundary(cfg.validate(D), D, 0).train()
    if method == "mapl-rvq":
        comp.rvq.dead_code_threshold = comp.recv.dead_code_threshold = 1e9    # every code is dead: revive each message
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, D, generator=gen, requires_grad=True)
    for _ in range(3):                                         # k-means init, then EMA updates and revivals
        with counting_host_reads() as c:
            _boundary_micro_batch(comp, x)
        assert c.total == 0, c.counts
    comp.eval()
    with torch.no_grad(), counting_host_reads() as c:
        _boundary_micro_batch(comp, x)
    assert c.total == 0, c.counts
    if method == "mapl-rvq":
        assert comp.rvq.host_version == int(comp.rvq.version) == int(comp.sync.seen_version) == 3
        assert comp.check_sync()["ok"]


@pytest.mark.slow
def test_no_training_or_evaluation_micro_batch_reads_the_host(monkeypatch):
    """A whole micro-batch of the single-process pipeline (P = 2: stage 0, the boundary's wire both ways, stage 1
    with its loss, backward), the first (MAPL+RVQ's k-means start) and a later one, then an evaluation micro-batch:
    no method reads the host. The counter would see the header read the RVQ receiver used to make: put back, it is
    counted once per message."""
    from mapl.core.compress.rvq import RVQCompressor
    from mapl.core.stages import build_staged_model

    def reads(method: str, ratio: float) -> list[dict]:
        sm = build_staged_model(load_run_config("micro", {"method": method, "ratio": ratio, "stages": 2}), 256).train()
        gen = torch.Generator().manual_seed(0)
        counts = []
        for training in (True, True, True, False):
            sm.train(training)
            ids, y = (torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2))
            with counting_host_reads() as c, torch.set_grad_enabled(training):
                loss = sm(ids, y)
                if training:
                    loss.backward()
            counts.append(dict(c.counts))
        return [counts[0], counts[2], counts[3]]                  # first, later, evaluation
    for method, ratio in (("none", 1.0), ("int8", 1.0), ("ssn", 4.0), ("mapl", 4.0), ("mapl-rvq", 4.0)):
        assert reads(method, ratio) == [{}, {}, {}], method
    unpack = RVQCompressor.unpack

    def reading_unpack(self, payload, dtype):
        payload[1 + self._n_scales].tolist()              # what the receiver read per message before
        return unpack(self, payload, dtype)
    monkeypatch.setattr(RVQCompressor, "unpack", reading_unpack)
    assert reads("mapl-rvq", 4.0)[1:] == [{"tolist": 1}, {"tolist": 1}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: its sync debug mode flags every host sync")
@pytest.mark.parametrize("method", ["none", "int8", "ssn", "mapl", "mapl-rvq"])
def test_host_syncs_per_micro_batch_on_cuda(method):
    """The same on a GPU, counted by CUDA's own sync detector (host reads and blocking copies alike)."""
    import warnings
    from mapl.core.compress import build_boundary
    from mapl.core.config import CompressorConfig
    D = 64
    cfg = CompressorConfig(method=method, ratio=1.0 if method in ("none", "int8") else 4.0)
    comp = build_boundary(cfg.validate(D), D, 0).train().cuda()
    x = torch.randn(2, 24, D, device="cuda", requires_grad=True)
    for _ in range(3):
        _boundary_micro_batch(comp, x)                         # k-means init; pinned buffers allocated
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _boundary_micro_batch(comp, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) <= (1 if method == "mapl-rvq" else 0), [str(w.message) for w in syncs]


# ---- SPEL computes in full float32 whatever TF32 / matmul precision the caller set -------------------
def _spel_once(p0: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    from mapl.core.optim import SPEL
    p = torch.nn.Parameter(p0.clone())
    p.grad = g.clone()
    SPEL([p], lr=0.05, polar="polar_express").step()
    return p.detach()


@pytest.fixture
def reduced_precision():
    """The caller (e.g. accelerate with a dynamo backend) allowed TF32 / bf16 passes for float32 matmuls."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def test_spel_orthogonalises_in_ieee_fp32_and_restores_the_callers_flags(monkeypatch, reduced_precision):
    from mapl.core import optim
    seen, retract = [], optim._retract
    monkeypatch.setattr(optim, "_retract", lambda *a: seen.append(
        (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        or retract(*a))
    gen = torch.Generator().manual_seed(0)
    _spel_once(optim.stiefel_random(256, 64, 1), torch.randn(256, 64, generator=gen))
    assert seen == [("highest", False, False)]
    assert torch.get_float32_matmul_precision() == "medium" and torch.backends.cudnn.allow_tf32


def test_spel_result_does_not_depend_on_the_callers_matmul_precision(reduced_precision):
    """On a CPU with bf16 units (oneDNN), 'medium' moves a 1024 x 256 matmul by ~5e-5; SPEL's step
    must come out bit-identical to the one under 'highest'."""
    from mapl.core.optim import ortho_error, stiefel_random
    gen = torch.Generator().manual_seed(0)
    p0, g = stiefel_random(1024, 256, 1), torch.randn(1024, 256, generator=gen)
    medium = _spel_once(p0, g)
    torch.set_float32_matmul_precision("highest")
    assert torch.equal(medium, _spel_once(p0, g)) and ortho_error(medium) < 1e-5


@pytest.mark.process
def test_spel_pins_ieee_fp32_through_the_new_precision_api_too():
    """A caller that set TF32 through the per-backend ``fp32_precision`` switches (reading the legacy
    flags then raises): SPEL sets and restores those instead (a fresh process: the mix is global)."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import torch\nfrom mapl.core import optim\nseen = []\nr = optim._retract\n"
            "optim._retract = lambda *a: seen.append((torch.backends.cuda.matmul.fp32_precision, "
            "torch.backends.mkldnn.matmul.fp32_precision)) or r(*a)\n"
            "torch.backends.cuda.matmul.fp32_precision = 'tf32'\ntorch.backends.mkldnn.matmul.fp32_precision = 'bf16'\n"
            "p = torch.nn.Parameter(optim.stiefel_random(64, 16, 1)); p.grad = torch.ones(64, 16)\n"
            "optim.SPEL([p], lr=0.1, polar='polar_express').step()\n"
            "print(seen, torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.split() == ["[('ieee',", "'ieee')]", "tf32", "bf16"]


# ---- the LM head's cross-entropy in chunks ---------------------------------------------------------
def test_chunked_linear_cross_entropy_equals_the_one_block_loss_forward_and_backward():
    import torch.nn.functional as F

    from mapl.core.stages import chunked_linear_cross_entropy
    gen = torch.Generator().manual_seed(0)
    h0, w0 = torch.randn(300, 48, generator=gen), torch.randn(1000, 48, generator=gen) * 0.2
    y = torch.randint(0, 1000, (300,), generator=gen)
    grads = []
    for chunk in (0, 64, 299):                               # 300 tokens: 5 chunks and a partial one; 2 chunks
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = (F.cross_entropy(F.linear(h, w).float(), y) if chunk == 0
                else chunked_linear_cross_entropy(h, w, y, chunk))
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    for loss, gh, gw in grads[1:]:
        torch.testing.assert_close(loss, grads[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(gh, grads[0][1], rtol=0, atol=1e-6)
        torch.testing.assert_close(gw, grads[0][2], rtol=0, atol=1e-6)


def test_the_last_stage_loss_in_chunks_matches_the_plain_one_and_keeps_nothing_vocab_wide():
    """A real last stage (micro model, P = 2, MAPL): loss and every parameter gradient within 1e-6 of
    the one-block loss; what autograd keeps drops by the V-wide log-softmax output."""
    from mapl.core.memory import memory_plan
    from mapl.core.stages import build_staged_model
    cfg = load_run_config("micro", {"method": "mapl", "ratio": 4, "stages": 2}).validate(256)
    t = cfg.train
    B, T = t.batch_size // t.micro_batches, t.seq_len
    gen = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 256, (B, T), generator=gen), torch.randint(0, 256, (B, T), generator=gen)
    sm = build_staged_model(cfg, 256).prune_to_stage(1)
    z = torch.randn(B, T, sm.boundaries["0"].code_dim, generator=gen)
    runs = []
    for chunk in (0, 48):
        sm.zero_grad(set_to_none=True)
        saved, loss = _saved_bytes(lambda: sm.stage_loss(1, z, ids, y, chunk), [])
        loss.backward()
        runs.append((saved, loss.detach(), {n: p.grad.clone() for n, p in sm.named_parameters() if p.grad is not None}))
    (plain_saved, plain, plain_g), (chunk_saved, chunked, chunk_g) = runs
    torch.testing.assert_close(chunked, plain, rtol=0, atol=1e-6)
    assert plain_g.keys() == chunk_g.keys()
    for n in plain_g:
        torch.testing.assert_close(chunk_g[n], plain_g[n], rtol=0, atol=1e-6, msg=n)
    assert plain_saved - chunk_saved >= 4 * 256 * B * T            # log-softmax's fp32 output is gone
    # the memory plan says the same: the head term drops by the V-wide part per micro-batch alive
    plans = [memory_plan(load_run_config("micro", {"method": "mapl", "ratio": 4, "stages": 2,
                                                   "train.loss_chunk_tokens": c}), 256, device="cpu")
             for c in (0, 48)]
    assert plans[0].stages[1].head - plans[1].stages[1].head == plans[0].stages[1].alive * 4 * 256 * B * T


def test_loss_chunking_is_hashed_only_when_set_and_may_change_on_resume():
    from mapl.core.config import RESUMABLE_FIELDS
    plain = load_run_config("micro")
    assert config_hash(load_run_config("micro", {"train.loss_chunk_tokens": 0})) == config_hash(plain)
    assert config_hash(load_run_config("micro", {"train.loss_chunk_tokens": 4096})) != config_hash(plain)
    assert "train.loss_chunk_tokens" in RESUMABLE_FIELDS
    assert load_run_config("paper").train.loss_chunk_tokens > 0 == load_run_config("cpu").train.loss_chunk_tokens
    with pytest.raises(ConfigError, match=r"train\.loss_chunk_tokens=-1 is invalid: must be >= 0"):
        load_run_config("micro", {"train.loss_chunk_tokens": -1}).validate()


# ---- timings where the work runs: CUDA events on a GPU, the host clock on a CPU -----------------------
class _FakeEvent:
    """Stands for torch.cuda.Event: time is a counter the test advances; ``query`` says whether the
    device has reached it; ``synchronize`` is counted (a host sync timing must not add mid-run)."""
    now_ms, done, syncs = 0.0, True, 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = _FakeEvent.now_ms

    def query(self):
        return _FakeEvent.done

    def synchronize(self):
        _FakeEvent.syncs += 1

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.fixture
def fake_cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.now_ms, _FakeEvent.done, _FakeEvent.syncs = 0.0, True, 0
    return _FakeEvent


class _SlowWork:
    def wait(self):
        import time
        time.sleep(0.03)
        _FakeEvent.now_ms += 250.0          # what the device spent waiting, in the fake's clock


def _transport(monkeypatch, device: str):
    import torch.distributed as dist

    from mapl.core.runtime.transport import Transport
    monkeypatch.setattr(dist, "new_group", lambda **kw: None)      # no process group needed to time a wait
    tx = Transport(0, None, None, torch.device(device), 5.0)
    tx.pending = [(_SlowWork(), None)]
    return tx


def test_a_failed_operation_names_what_the_stage_was_doing_innermost_first(monkeypatch):
    """``Transport.during`` names the block an operation fails in; leaving a block restores the outer name,
    so an error after it is never reported under a stale one."""
    from mapl.core.runtime.transport import CommError
    tx = _transport(monkeypatch, "cpu")

    class _Broken:
        def wait(self):
            raise RuntimeError("connection reset")
    for doing, expected in [(("step 3 (F1)",), "step 3 (F1)"), (("step 3 (end)", "state sync"), "state sync"),
                            ((), "setup")]:
        with contextlib.ExitStack() as blocks:
            for name in doing:
                blocks.enter_context(tx.during(name))
            tx.pending = [(_Broken(), None)]
            with pytest.raises(CommError, match=rf"completing sends .* failed during {re.escape(expected)}: a peer "
                                                r".*\(RuntimeError: connection reset\)"):
                tx.flush()
    with tx.during("checksum after step 4"):
        pass
    tx.pending = [(_Broken(), None)]
    with pytest.raises(CommError, match="failed during setup"):
        tx.flush()


def test_waits_are_timed_by_the_host_clock_on_a_cpu(monkeypatch, fake_cuda_events):
    tx = _transport(monkeypatch, "cpu")
    tx.flush()                                              # outside a step: not counted
    tx.clock.begin_step()
    tx.pending = [(_SlowWork(), None)]
    tx.flush()
    tx.clock.end_step()
    assert tx.clock.per_step["wait"][0] >= 0.03 and tx.clock.per_step["opt"] == [0.0]
    assert not tx.clock.cuda and fake_cuda_events.syncs == 0


def test_waits_and_the_step_end_are_timed_by_cuda_events_on_a_gpu_without_a_host_sync(monkeypatch, fake_cuda_events):
    tx = _transport(monkeypatch, "cuda")
    clock = tx.clock
    clock.begin_step()
    tx.flush()                                              # host: 30 ms; device: 250 ms of stream wait
    started = clock.start()
    fake_cuda_events.now_ms += 40.0                         # the optimizer's kernels
    clock.stop("opt", started)
    fake_cuda_events.done = False                           # the device has not got there yet
    clock.end_step()
    assert clock.per_step == {"wait": [0.0], "opt": [0.0]} and fake_cuda_events.syncs == 0
    fake_cuda_events.done = True
    clock.begin_step()
    clock.end_step()                                        # read once complete, still no sync
    assert clock.per_step == {"wait": [0.25, 0.0], "opt": [0.04, 0.0]} and fake_cuda_events.syncs == 0
    clock.begin_step()
    started = clock.start()
    fake_cuda_events.now_ms += 10.0
    clock.stop("opt", started)
    fake_cuda_events.done = False
    clock.end_step()
    assert clock.collect(block=True)["opt"] == [0.04, 0.0, 0.01] and fake_cuda_events.syncs == 1   # end of run


# ---- sends are released one batch later, not held to the step's end -------------------------------------
class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(self.name)


def test_release_completes_the_older_sends_only_and_counts_what_was_held(monkeypatch):
    import torch.distributed as dist
    waited, sent = [], []
    monkeypatch.setattr(dist, "isend", lambda buf, peer, group=None, tag=0: sent.append(buf.numel())
                        or _Work(waited, len(sent)))
    tx = _transport(monkeypatch, "cpu")
    tx.pending = []
    tx.send([torch.zeros(4)], 1, "fwd")                            # 16 bytes
    tx.send([torch.zeros(2, dtype=torch.float64)], 1, "sync")      # 16 bytes
    tx.release(keep=1)
    assert waited == [1] and len(tx.pending) == 1 and tx.pending[0][0].name == 2
    tx.send([torch.zeros(8, dtype=torch.bfloat16)], 1, "fwd")      # 16 bytes
    tx.release(keep=1)
    assert waited == [1, 2] and len(tx.pending) == 1
    tx.flush()
    assert waited == [1, 2, 3] and tx.pending == []
    assert tx.held_peak == (2, 32)


# ---- evaluation in micro-batches (train.eval_micro_batch_size) ---------------------------------------------
def test_evaluation_in_micro_batches_equals_the_whole_batch_and_is_opt_in(micro_cfg):
    """Each validation batch evaluated a few sequences at a time gives the whole batch's
    loss to float tolerance (pieces of 1 and 3 sequences, a smaller last piece included); unset, it is the
    one-block evaluation, and only a set value enters the config hash."""
    from dataclasses import replace

    from mapl.core.engine import LocalEngine, eval_pieces
    torch.manual_seed(0)
    cfg = micro_cfg("mapl", 4)
    engine = LocalEngine.build(cfg)
    engine.train_step(0, 1.0)
    losses = {}
    for seqs in (0, 1, 3):
        engine.cfg = replace(cfg, train=replace(cfg.train, eval_micro_batch_size=seqs))
        losses[seqs] = engine.evaluate(0).val
    assert abs(losses[1] - losses[0]) < 1e-6 * losses[0] and abs(losses[3] - losses[0]) < 1e-6 * losses[0], losses
    x, y = torch.zeros(4, 8), torch.zeros(4, 8)
    assert [(len(a), s) for a, _, s in eval_pieces(x, y, 3)] == [(3, 0.75), (1, 0.25)]
    assert [(len(a), s) for a, _, s in eval_pieces(x, y, 0)] == [(4, 1.0)]
    plain = load_run_config("micro")
    assert config_hash(load_run_config("micro", {"train.eval_micro_batch_size": 0})) == config_hash(plain)
    assert config_hash(load_run_config("micro", {"train.eval_micro_batch_size": 2})) != config_hash(plain)
    with pytest.raises(ConfigError, match=r"^train\.eval_micro_batch_size=-1 is invalid: must be >= 0"):
        load_run_config("micro", {"train.eval_micro_batch_size": -1}).validate()


# ---- evaluation reads the device once per evaluation set ---------------------------------------------------
class _OneRankTransport:
    """The transport calls a one-stage evaluation makes: nothing to send, an all-reduce over one rank."""

    def during(self, what: str):
        return contextlib.nullcontext()

    def all_reduce(self, tensor, what: str, group=None) -> None:
        pass

    def flush(self) -> None:
        pass


def test_the_runtimes_evaluation_sums_on_the_device_and_reads_it_once():
    """The last stage's pieces (here 1-sequence pieces of three batches, the last one smaller) are summed on
    the device in float64, as the host summed them before: one read per evaluation set, the same number."""
    from types import SimpleNamespace

    from mapl.core.engine import batch_weight, eval_pieces
    from mapl.core.runtime.worker import PipelineEngine
    from mapl.core.stages import build_staged_model
    cfg = load_run_config("micro", {"stages": 1, "method": "none", "train.eval_micro_batch_size": 1}).validate(256)
    torch.manual_seed(0)
    sm = build_staged_model(cfg, 256)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 256, (n, 32), generator=gen) for _ in range(2)) for n in (3, 3, 2)]
    engine = PipelineEngine.__new__(PipelineEngine)              # the one stage of a one-stage pipeline
    engine.sm, engine.cfg, engine.R, engine.stage, engine.P, engine.tx = sm, cfg, 1, 0, 1, _OneRankTransport()
    engine.topo = SimpleNamespace(replica=0, first=True, last=True, device=torch.device("cpu"))
    with counting_host_reads() as reads:
        got = engine._validation_loss(0, batches, "evaluation")
    assert reads.counts == {"tolist": 1}
    sm.eval()
    total, weight = 0.0, 0.0
    with torch.no_grad():
        for x, y in batches:
            bw = batch_weight(y, batches)
            for xi, yi, share in eval_pieces(x, y, 1):
                total += float(sm(xi, yi)) * (bw * share)       # what the host summed, piece by piece
            weight += bw
    assert got == total / max(1.0, weight)
