"""The kit's measurements on one GPU (or, at micro shapes, on a CPU): each function returns one record's fields.

* ``speed``: a paper-shape pipeline (P = 4, 1F1B) measured stage by stage in one process, as each stage's
  process would run it: unpack, forward (the last stage the runtime's chunked ``stage_loss``), pack; then
  unpack_grad, backward, pack_grad; then the stage's own optimizer step. One stage's activations are alive at a
  time, so the 1B model at 16 x 2048-token micro-batches needs about 35 GiB, not the 75 GiB of all four stages'.
  A stage that is not the last gets a random gradient of its output's shape (the real one would come from the
  next stage's backward: the same shapes, so the same times). MFU is the cost model's FLOPs
  (``mapl.planning.costmodel.stage_flops``) over the measured compute, so it is the number that replaces the
  cost model's assumed MFU; the step time on each link is the cost model's, fed the measured times.
* ``rvq_kernel``: the fused RVQ search's cold compile time and its transient memory against the plan's.
* ``syncs``: device syncs per training micro-batch through a boundary, per method (CUDA's own detector).
* ``ceiling``: the card's bf16 matmul rate and copy bandwidth.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

from mapl.core.compress.base import payload_bytes
from mapl.core.compress.rvq.search import residual_search, search_transient_bytes, warm_fused_search
from mapl.core.config import load_run_config
from mapl.core.engine import autocast_ctx, stage_of_parameter
from mapl.core.link import get_profile
from mapl.core.memory import memory_plan
from mapl.core.model import ModelConfig
from mapl.core.optimizer_recipe import build_optimizers
from mapl.core.stages import build_staged_model
from mapl.planning.costmodel import build_case, measured_compute, stage_flops

__all__ = ["METHODS", "LINKS", "speed_config", "speed", "rvq_kernel", "syncs", "ceiling", "free"]

METHODS = {"none": 1.0, "int8": 1.0, "ssn": 4.0, "mapl": 4.0, "mapl-rvq": 4.0}
LINKS = ("1Gbps", "200Mbps", "80Mbps")
CPU_LOSS_CHUNK = 16          # the CPU rehearsal's loss chunk: its micro-batch in several chunks, as the paper's 4,096


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def timed(device: torch.device, out: dict, key: str):
    """Adds the block's seconds to ``out[key]``, the device synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    yield
    sync(device)
    out[key] = out.get(key, 0.0) + time.perf_counter() - t0


def ceiling(device: torch.device, small: bool) -> dict:
    """The card's bf16 matmul FLOP/s (n x n x n) and device-to-device copy bytes/s, medians of 10."""
    n = 256 if small else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn((1 << 16) if small else (1 << 28), device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def median_s(fn):
        times = {}
        for i in range(13):
            with timed(device, times, i):
                fn()
        return statistics.median(list(times.values())[3:])
    return {"n": n, "matmul_flops": 2 * n ** 3 / median_s(lambda: a @ b),
            "copy_bytes_per_s": 2 * x.numel() * x.element_size() / median_s(lambda: y.copy_(x))}


# ---- speed ----------------------------------------------------------------------------------------------------
def speed_config(model: str, method: str, seqs: int, small: bool):
    """The paper profile's run at P = 4, 1F1B, bf16, 512 x 2048 tokens per step in micro-batches of ``seqs``
    sequences (16: M = 32, the paper's; 8: M = 64), r = 256. ``small``: the micro profile, 8 x 32 tokens per step."""
    seq_len, batch = (32, 8) if small else (2048, 512)
    ratio = METHODS[method]
    if ratio > 1 and not small:               # r = 256 at every width: 4x at 150M, 8x at 1B
        ratio = ModelConfig.preset(model).d_model / 256
    over = {"model": model, "method": method, "ratio": ratio, "stages": 4, "train.schedule": "1f1b",
            "train.precision": "bf16", "train.seq_len": seq_len, "train.batch_size": batch,
            "train.micro_batches": batch // seqs, "train.activation_checkpointing": "off"}
    if small:
        over["train.loss_chunk_tokens"] = CPU_LOSS_CHUNK
    elif model == "1B":                       # the paper's 1B learning rates (the times do not depend on them)
        over.update({"train.lr_muon": 0.01, "train.lr_adam": 0.005, "train.lr_embed": 0.005, "train.lr_head": 0.005})
    return load_run_config("micro" if small else "paper", over)


class _Probe:
    """The untimed pass's per-stage counts: bytes one micro-batch keeps for its backward (distinct storages that
    autograd saves, plus the stage's input and output; parameters and buffers excluded, as tests/test_memory.py
    counts them) and the FLOPs of forward and backward (torch's counter; a CPU's SDPA counts none)."""

    def __init__(self, sm):
        self.static = {t.untyped_storage().data_ptr() for t in [*sm.parameters(), *sm.buffers()]}
        P = sm.n_stages
        self.kept: list[dict[int, int]] = [{} for _ in range(P)]
        self.fwd_flops, self.bwd_flops = [0] * P, [0] * P

    def saved(self) -> list[int]:
        return [sum(n for ptr, n in kept.items() if ptr not in self.static) for kept in self.kept]

    def hold(self, s: int, *tensors) -> None:
        for t in tensors:
            if t is not None:
                self.kept[s][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    @contextlib.contextmanager
    def forward(self, s: int):
        def pack(t):
            self.hold(s, t)
            return t
        with FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.fwd_flops[s] = flops.get_total_flops()

    @contextlib.contextmanager
    def backward(self, s: int):
        with FlopCounterMode(display=False) as flops:
            yield
        self.bwd_flops[s] = flops.get_total_flops()


def _probing(probe, what: str, s: int):
    return getattr(probe, what)(s) if probe is not None else contextlib.nullcontext()


def _allocated(device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def stage_pass(sm, ids, targets, cfg, device, probe: _Probe | None = None) -> dict:
    """One micro-batch through every stage, one stage at a time, every operation timed."""
    P, comps, t = sm.n_stages, sm.compressors(), {}
    fwd_bytes, bwd_bytes, retained = [0] * (P - 1), [0] * (P - 1), [None] * P
    id_bytes = sm.id_bytes_per_token() * ids.numel()
    msg = dtype = loss = None
    for s in range(P):
        x = None
        if s > 0:
            with timed(device, t, f"unpack{s - 1}"):
                x = comps[s - 1].unpack(msg, dtype)
            x = x.detach().requires_grad_(True)
        base = _allocated(device)
        with timed(device, t, f"fwd{s}"), _probing(probe, "forward", s), autocast_ctx(cfg, device):
            if s == P - 1:
                out = sm.stage_loss(s, x, ids, targets, cfg.train.loss_chunk_tokens)
            else:
                out = sm.stage_forward(s, x, ids)
        if base is not None:
            retained[s] = _allocated(device) - base
        if probe is not None:
            probe.hold(s, x, out if s < P - 1 else None)
        grad = None
        if s < P - 1:
            with timed(device, t, f"pack{s}"):
                msg = comps[s].pack(out)
            dtype, fwd_bytes[s] = out.dtype, payload_bytes(msg) + id_bytes
            grad_msg = comps[s].pack_grad(1e-3 * torch.randn_like(out))   # what stage s + 1 sends back
            bwd_bytes[s] = payload_bytes(grad_msg)
            with timed(device, t, f"unpack_grad{s}"):
                grad = comps[s].unpack_grad(grad_msg, out.dtype)
        else:
            loss = float(out.detach())
        with timed(device, t, f"bwd{s}"), _probing(probe, "backward", s):
            out.backward(grad)
        if s > 0:
            with timed(device, t, f"pack_grad{s - 1}"):
                comps[s - 1].pack_grad(x.grad)
        del out, x, grad
    return {"t": t, "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes, "retained": retained, "loss": loss}


def stage_optimizers(sm, cfg) -> list[list[torch.optim.Optimizer]]:
    """One optimizer set per stage, as each stage's process builds it."""
    named = [(n, p) for n, p in sm.named_parameters() if p.requires_grad]
    return [build_optimizers(sm, cfg, exclude={id(p) for n, p in named if stage_of_parameter(n, sm.split) != s})
            for s in range(sm.n_stages)]


def optimizer_steps(sm, opts, cfg, device) -> list[float]:
    """Each stage's step end, timed apart: the receiver-side projector gradient it owns, its clipping, its
    optimizers, the projector it ships to the receiver."""
    comps, times = sm.compressors(), []
    named = [(n, p) for n, p in sm.named_parameters() if p.requires_grad]
    for s in range(sm.n_stages):
        t = {}
        with timed(device, t, "opt"):
            if s < sm.n_stages - 1:
                comps[s].fold_receiver_grad()
            own = [p for n, p in named if p.grad is not None and stage_of_parameter(n, sm.split) == s]
            if cfg.train.grad_clip and own:
                torch.nn.utils.clip_grad_norm_(own, cfg.train.grad_clip)
            for opt in opts[s]:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if s < sm.n_stages - 1:
                with torch.no_grad():
                    comps[s].apply_sync(comps[s].sync_payload())
        times.append(t["opt"])
    return times


def speed(cfg, vocab: int, device: torch.device, peak_flops: float, reps: int) -> dict:
    """Per-stage times, bytes, memory and MFU of one configuration, and its step time on each link."""
    t0 = time.perf_counter()
    sm = build_staged_model(cfg, vocab).to(device).train()
    opts = stage_optimizers(sm, cfg)
    P, tr = sm.n_stages, cfg.train
    mb, M = tr.batch_size // tr.micro_batches, tr.micro_batches
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, vocab, (mb, tr.seq_len), generator=gen).to(device) for _ in range(2))
               for _ in range(reps + 2)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probe = _Probe(sm)
    stage_pass(sm, *batches[0], cfg, device, probe)        # untimed: kernels, RVQ's k-means start, the counts
    optimizer_steps(sm, opts, cfg, device)
    stage_pass(sm, *batches[1], cfg, device)               # untimed: the optimizer state exists from here on
    optimizer_steps(sm, opts, cfg, device)
    warmup_s = time.perf_counter() - t0
    passes, opt_times = [], []
    for x, y in batches[2:]:
        passes.append(stage_pass(sm, x, y, cfg, device))
        opt_times.append(optimizer_steps(sm, opts, cfg, device))
    ops = {k: statistics.median(p["t"][k] for p in passes) for k in passes[0]["t"]}
    fwd = [ops.get(f"unpack{s - 1}", 0.0) + ops[f"fwd{s}"] + ops.get(f"pack{s}", 0.0) for s in range(P)]
    bwd = [ops.get(f"unpack_grad{s}", 0.0) + ops[f"bwd{s}"] + ops.get(f"pack_grad{s - 1}", 0.0) for s in range(P)]
    opt = [statistics.median(o[s] for o in opt_times) for s in range(P)]
    flops = stage_flops(cfg, vocab)
    model_flops = sum(f["fwd"] + f["bwd"] for f in flops)
    case = build_case(cfg, measured_compute({"fwd_s": [[f] * M for f in fwd], "bwd_s": [[b] * M for b in bwd],
                                             "opt_s": opt}), vocab_size=vocab)
    links = {}
    for name in LINKS:
        pred = case.predict(get_profile(name))
        links[name] = {"step_s": pred.step_s, "compute_s": pred.compute_s, "floor_s": pred.floor_s,
                       "tokens_per_s": tr.batch_size * tr.seq_len / pred.step_s}
    plan = memory_plan(cfg, vocab, device=device.type, checkpointing=False)
    plan_mb = [(st.activations + st.head) // max(1, st.alive) for st in plan.stages]
    saved = probe.saved()
    rec = {"micro_batch_seqs": mb, "micro_batches": M, "tokens_per_micro_batch": mb * tr.seq_len,
           "fwd_s": fwd, "bwd_s": bwd, "opt_s": opt, "ops_s": ops,
           "wire_ops_s": sum(v for k, v in ops.items() if k.startswith(("pack", "unpack"))),
           "mfu": model_flops / (sum(fwd) + sum(bwd)) / peak_flops,
           "mfu_per_stage": [(f["fwd"] + f["bwd"]) / (a + b) / peak_flops for f, a, b in zip(flops, fwd, bwd)],
           "model_flops": model_flops, "peak_flops": peak_flops, "links": links,
           "fwd_bytes": passes[-1]["fwd_bytes"], "bwd_bytes": passes[-1]["bwd_bytes"],
           "model_fwd_bytes": [b.fwd for b in case.wire], "model_bwd_bytes": [b.bwd for b in case.wire],
           "saved_bytes": saved, "plan_bytes": plan_mb,
           "saved_over_plan": [a / b if b else None for a, b in zip(saved, plan_mb)],
           "retained_bytes": passes[-1]["retained"],
           "fwd_flops": probe.fwd_flops, "bwd_flops": probe.bwd_flops,
           "model_fwd_flops": [f["fwd"] for f in flops], "model_bwd_flops": [f["bwd"] for f in flops],
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
           "losses": [p["loss"] for p in passes], "warmup_s": warmup_s}
    del sm, opts, passes, batches
    free(device)
    return rec


# ---- the fused RVQ search -------------------------------------------------------------------------------------
def rvq_kernel(device: torch.device, groups: int, K: int, ds: int, tokens: int, rounds: int) -> dict:
    """Cold compile of the fused search for (groups, K, ds), then one search of ``tokens`` tokens: its transient
    memory (CUDA's allocator) against ``search_transient_bytes``, the plan's ``rvq_search`` term."""
    torch._dynamo.reset()
    t = {}
    with timed(device, t, "compile"):
        warm_fused_search(groups, K, ds, torch.float32, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, groups, ds, generator=gen).to(device)
    C = torch.randn(groups, rounds, K, ds, generator=gen).to(device)
    with torch.no_grad(), timed(device, t, "first"):          # a new token count: compiled again if at all
        residual_search(x, C, kernel="fused", return_residual=True)
    before = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad(), timed(device, t, "search"):
        residual_search(x, C, kernel="fused", return_residual=True)
    transient = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    plan = search_transient_bytes(tokens, groups, rounds, K, ds, kernel="fused", device=device)
    distances = groups * tokens * K * 4                        # what an unfused kernel writes: (G, N, K) fp32
    return {"groups": groups, "K": K, "ds": ds, "tokens": tokens, "rounds": rounds, "compile_s": t["compile"],
            "first_call_s": t["first"], "search_s": t["search"], "transient_bytes": transient, "plan_bytes": plan,
            "transient_over_plan": None if transient is None else transient / plan,
            "fused": None if transient is None else transient < distances / 4}


# ---- device syncs per micro-batch -----------------------------------------------------------------------------
def _micro_batch(sm, cfg, ids: torch.Tensor, y: torch.Tensor, device) -> None:
    """One training micro-batch of the single-process pipeline: forward through every wire, backward."""
    with autocast_ctx(cfg, device):
        loss = sm(ids, y)
    loss.backward()


def syncs(device: torch.device, model: str, seqs: int, seq_len: int, small: bool) -> dict:
    """Per method, P = 2 in one process: syncs CUDA's detector reports over one training micro-batch (forward
    through the boundary's wire both ways, backward; its tokens already on the device), after two that warm it
    up; None on a CPU."""
    rows = {}
    for method, ratio in METHODS.items():
        cfg = load_run_config("micro" if small else "paper", {"model": model, "method": method, "ratio": ratio,
                                                               "stages": 2, "train.loss_chunk_tokens": 0})
        vocab = cfg.model_config().vocab_size
        sm = build_staged_model(cfg, vocab).to(device).train()
        gen = torch.Generator().manual_seed(0)
        batches = [[torch.randint(0, vocab, (seqs, seq_len), generator=gen).to(device) for _ in range(2)]
                   for _ in range(3)]
        for ids, y in batches[:2]:
            _micro_batch(sm, cfg, ids, y, device)
        sync(device)
        rows[method] = None
        if device.type == "cuda":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _micro_batch(sm, cfg, *batches[2], device)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            rows[method] = sum("synchroniz" in str(w.message) for w in caught)
        del sm, batches
        free(device)
    return {"model": model, "shape": [seqs, seq_len], "syncs": rows,
            "methods_without_syncs": [m for m, n in rows.items() if n == 0]}
