"""Part A of benchmarks/gpu.py: speed at the paper shape, stage by stage, on one GPU.

One GPU holds every stage, so each stage is measured in turn in one process, as a pipeline process
would run it: stage s's forward (``StagedModel.stage_forward`` under bf16 autocast; the last stage is
``StagedModel.stage_loss`` with the profile's ``train.loss_chunk_tokens``, exactly the runtime's call:
the head's cross-entropy in chunks whose logits are recomputed in backward), the sender's ``pack``
and the receiver's ``unpack`` of its message (outside autocast, as the pipeline's workers call them), then,
in reverse, each stage's backward from the unpacked gradient and ``pack_grad``/``unpack_grad`` of the
gradient it sends back; then every stage's own optimizer step (its clipping norm, its optimizers, its
projector sync). Every timed block is bracketed by ``torch.cuda.synchronize``. One untimed pass +
optimizer step first: CUDA context, kernel selection, optimizer state and RVQ's k-means codebook init
stay out of the numbers.

The untimed pass is also the probe (``plan_check``, any device): per stage the bytes autograd saves for
the backward (distinct storages, parameters and buffers excluded) against the memory plan's per
micro-batch activations and head terms (``mapl.core.memory``), and the FLOPs of its forward and backward
(``torch.utils.flop_counter``; no attention FLOPs on a CPU, whose SDPA has no formula) against the cost
model's (``mapl.planning.costmodel.stage_flops``) and the head's recompute, which the cost model does not
count: a chunked loss's backward runs the head's matmul once more.

Per-stage memory (CUDA only): ``retained`` = bytes a micro-batch's forward leaves alive for its
backward, ``fwd_peak``/``bwd_peak`` = the highest allocation during the stage's forward (above its
start) and backward (above its start); static = parameters + gradients + optimizer state + the
compressor copies the stage holds. ``peak_1f1b`` combines them for a stage holding min(P - s, M)
micro-batches in flight (1F1B); it is an estimate assembled from measured parts, not a reading of a
pipeline process. ``process_peak`` is the real peak of this one process holding every stage.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from gpu_common import (H200_PEAK_BF16, autocast, build_model, epoch_batch, free_device, link_estimate, run_config,
                        stage_of_parameter, stage_optimizers, sync, timed)
from mapl.core.compress.base import payload_bytes
from mapl.core.memory import memory_plan
from mapl.core.model import ModelConfig
from mapl.planning.costmodel import stage_flops

__all__ = ["speed_items", "measure_speed", "model_flops_per_token", "pipeline_pass", "plan_check", "DRY_LOSS_CHUNK"]

DRY_LOSS_CHUNK = 16          # the dry run's loss chunk: its 2 x 32-token micro-batch in 4 chunks (the paper: 4,096)


def speed_items(dry: bool) -> list[dict]:
    """What part A measures: the 150M grid at P = 4 (r = 256: 4x, mapl-rvq 8x on the wire) and none/mapl
    at 1B (r = 256: 8x). Dry: the same items at the micro/tiny presets."""
    small, large = ("micro", "tiny") if dry else ("150M", "1B")
    grid = [(small, "none", 1.0), (small, "int8", 1.0), (small, "ssn", 4.0), (small, "mapl", 4.0),
            (small, "mapl-rvq", 4.0), (large, "none", 1.0), (large, "mapl", 8.0)]
    return [{"item": f"speed/{m}/{meth}", "model": m, "method": meth, "ratio": r} for m, meth, r in grid]


def shape(dry: bool) -> dict:
    """Micro-batch shape and micro-batches per step: the paper's 16 x 2048 tokens, 32 micro-batches
    (global batch 512 sequences) at P = 4 with 1F1B."""
    if dry:
        return {"mb": 2, "seq_len": 32, "micro_batches": 4, "stages": 4, "schedule": "1f1b"}
    return {"mb": 16, "seq_len": 2048, "micro_batches": 32, "stages": 4, "schedule": "1f1b"}


def speed_config(item: dict, dry: bool):
    sh = shape(dry)
    over = {"model": item["model"], "stages": sh["stages"], "method": item["method"], "ratio": item["ratio"],
            "train.batch_size": sh["mb"] * sh["micro_batches"], "train.micro_batches": sh["micro_batches"],
            "train.seq_len": sh["seq_len"], "train.schedule": sh["schedule"], "train.precision": "bf16"}
    if dry:                                           # the paper profile's own chunk; the micro profile has none
        over["train.loss_chunk_tokens"] = DRY_LOSS_CHUNK
    if item["model"] == "1B":                         # the paper's 1B learning rates (timing does not depend on them)
        over.update({"train.lr_muon": 0.01, "train.lr_adam": 0.005, "train.lr_embed": 0.005, "train.lr_head": 0.005})
    return run_config("micro" if dry else "paper", over)


def model_flops_per_token(mc: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's convention (Chowdhery et al. 2022, app. B): 6 x matmul parameters
    (blocks + LM head; the embedding is a lookup) + 12 x layers x d x T for attention scores and values
    (forward + backward, not halved for the causal mask). The uncompressed model's FLOPs for every
    method, so a method's compressor work shows up as lower MFU."""
    d, hd = mc.d_model, mc.head_dim
    block = d * mc.n_heads * hd + 2 * d * mc.n_kv_heads * hd + mc.n_heads * hd * d + 3 * d * mc.ffn_hidden
    return 6.0 * (mc.n_layers * block + d * mc.vocab_size) + 12.0 * mc.n_layers * d * seq_len


# ---- one micro-batch through every stage ---------------------------------------------------------------
class _Memory:
    """Allocation above the start of an op (CUDA); ``top`` = the highest absolute allocation seen."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.top = 0

    def begin(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def end(self, base: int) -> tuple[int | None, int | None]:
        """(peak above base, still allocated above base)."""
        if not self.cuda:
            return None, None
        peak = torch.cuda.max_memory_allocated(self.device)
        self.top = max(self.top, peak)
        return peak - base, torch.cuda.memory_allocated(self.device) - base


class _Probe:
    """What the untimed pass measures per stage: the bytes one micro-batch keeps for its backward (what
    autograd saves, and the received input and sent output the runtime holds, distinct storages, parameters
    and buffers excluded: as tests/test_memory.py counts them) and the FLOPs of forward and backward."""

    def __init__(self, sm, P: int):
        self.static = {t.untyped_storage().data_ptr() for t in [*sm.parameters(), *sm.buffers()]}
        self.kept: list[dict[int, int]] = [{} for _ in range(P)]
        self.fwd_flops, self.bwd_flops = [0] * P, [0] * P

    @property
    def saved(self) -> list[int]:
        return [sum(n for ptr, n in kept.items() if ptr not in self.static) for kept in self.kept]

    def hold(self, s: int, *tensors) -> None:
        """Tensors the runtime keeps for stage s's backward beside autograd's (its input, its output)."""
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


def _probing(probe: _Probe | None, what: str, s: int):
    return getattr(probe, what)(s) if probe is not None else contextlib.nullcontext()


def stage_output(sm, s: int, inp, ids, targets, cfg):
    """Stage s as the runtime runs it: ``stage_forward``, the last stage ``stage_loss`` with the config's
    ``train.loss_chunk_tokens`` (mapl/core/runtime/worker.py ``_forward``)."""
    if s == sm.n_stages - 1:
        return sm.stage_loss(s, inp, ids, targets, cfg.train.loss_chunk_tokens)
    return sm.stage_forward(s, inp, ids)


def pipeline_pass(sm, ids, targets, cfg, device, probe: _Probe | None = None) -> dict:
    """One micro-batch forward through stages 0..P-1 and backward through P-1..0, every op timed (with a
    ``probe``, each stage's forward and backward measured as well: the untimed pass only)."""
    P, comps, mem = sm.n_stages, sm.compressors(), _Memory(device)
    t, fwd_b, bwd_b = {}, [0] * (P - 1), [0] * (P - 1)
    retained, fwd_peak, bwd_peak = [None] * P, [None] * P, [None] * P
    ins, outs, msgs = [None] * P, [None] * P, [None] * (P - 1)
    id_bytes = sm.id_bytes_per_token() * ids.numel()
    for s in range(P):
        if s > 0:
            with timed(device, t, f"unpack{s - 1}"):
                z = comps[s - 1].unpack(msgs[s - 1], outs[s - 1].dtype)
            ins[s] = z.detach().requires_grad_(True)
        base = mem.begin()
        with timed(device, t, f"fwd{s}"), _probing(probe, "forward", s):
            with autocast(cfg, device):
                out = stage_output(sm, s, ins[s], ids, targets, cfg)
        fwd_peak[s], retained[s] = mem.end(base)
        if probe is not None:
            probe.hold(s, ins[s], out if s < P - 1 else None)
        outs[s] = out
        if s < P - 1:
            with timed(device, t, f"pack{s}"):
                msgs[s] = comps[s].pack(out)
            fwd_b[s] = payload_bytes(msgs[s]) + id_bytes
    loss = float(outs[-1].detach())
    grad_msg = None
    for s in reversed(range(P)):
        grad = None
        if s < P - 1:
            with timed(device, t, f"unpack_grad{s}"):
                grad = comps[s].unpack_grad(grad_msg, outs[s].dtype)
        base = mem.begin()
        with timed(device, t, f"bwd{s}"), _probing(probe, "backward", s):
            outs[s].backward(grad)
        bwd_peak[s], _ = mem.end(base)
        if s > 0:
            with timed(device, t, f"pack_grad{s - 1}"):
                grad_msg = comps[s - 1].pack_grad(ins[s].grad)
            bwd_b[s - 1] = payload_bytes(grad_msg)
        outs[s] = ins[s] = None                      # the stage's activations go, as after its backward
    return {"t": t, "fwd_bytes": fwd_b, "bwd_bytes": bwd_b, "retained": retained, "fwd_peak": fwd_peak,
            "bwd_peak": bwd_peak, "loss": loss, "top": mem.top if mem.cuda else None}


def optimizer_steps(sm, stage_opts, cfg, device) -> list[float]:
    """Each stage's step end, timed apart: fold the receiver-side projector gradient it owns, its local
    clipping norm, its optimizers, and the projector it ships to the receiver."""
    comps, times = sm.compressors(), []
    names = [(n, p) for n, p in sm.named_parameters() if p.requires_grad]
    for s in range(sm.n_stages):
        t = {}
        with timed(device, t, "opt"):
            if s < sm.n_stages - 1:
                comps[s].fold_receiver_grad()
            own = [p for n, p in names if p.grad is not None and stage_of_parameter(n, sm.split) == s]
            if cfg.train.grad_clip and own:
                torch.nn.utils.clip_grad_norm_(own, cfg.train.grad_clip)
            for opt in stage_opts[s]:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if s < sm.n_stages - 1:
                with torch.no_grad():
                    comps[s].apply_sync(comps[s].sync_payload())
        times.append(t["opt"])
    return times


def static_bytes(sm, stage_opts) -> list[int]:
    """Per stage: parameters + gradients (fp32, same size) + optimizer state + buffers; a boundary's
    compressor is held by its sender and (the receiver's copy) by the next stage."""
    P = sm.n_stages
    out = [0] * P
    for name, p in sm.named_parameters():
        s = stage_of_parameter(name, sm.split)
        nbytes = p.numel() * p.element_size() * (2 if p.requires_grad else 1)
        out[s] += nbytes
        if name.startswith("boundaries.") and s + 1 < P:
            out[s + 1] += p.numel() * p.element_size()
    for name, b in sm.named_buffers():
        s = stage_of_parameter(name, sm.split)
        out[s] += b.numel() * b.element_size()
        if name.startswith("boundaries.") and s + 1 < P:
            out[s + 1] += b.numel() * b.element_size()
    for s, opts in enumerate(stage_opts):
        for opt in opts:
            for state in opt.state.values():
                out[s] += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return out


def _median_over(passes: list[dict], key: str) -> float:
    return statistics.median(p["t"].get(key, 0.0) for p in passes)


def _stage_timing(passes: list[dict], opts: list[list[float]], P: int) -> dict:
    """Per-op medians, and the link model's per-stage op times: F = unpack + forward + pack,
    B = unpack_grad + backward + pack_grad (each stage does its own wire work)."""
    med = {k: _median_over(passes, k) for k in passes[0]["t"]}
    fwd = [med.get(f"unpack{s - 1}", 0.0) + med[f"fwd{s}"] + med.get(f"pack{s}", 0.0) for s in range(P)]
    bwd = [med.get(f"unpack_grad{s}", 0.0) + med[f"bwd{s}"] + med.get(f"pack_grad{s - 1}", 0.0) for s in range(P)]
    opt = [statistics.median(o[s] for o in opts) for s in range(P)]
    return {"ops_s": med, "fwd_s": fwd, "bwd_s": bwd, "opt_s": opt}


def measure_speed(item: dict, corpus, ctx) -> dict:
    """Measure one item; returns the record's fields (see module docstring)."""
    dry, device, vocab = ctx["dry"], ctx["device"], ctx["vocab"]
    cfg = speed_config(item, dry).validate(vocab)
    sh = shape(dry)
    t0 = time.perf_counter()
    sm = build_model(cfg, vocab, device)
    stage_opts = stage_optimizers(sm, cfg)
    build_s = time.perf_counter() - t0
    P = sm.n_stages
    batches = [epoch_batch(corpus, sh["mb"], sh["seq_len"], seed=1, step=i) for i in range(ctx["reps"] + 1)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    t0 = time.perf_counter()
    probe = _Probe(sm, P)
    pipeline_pass(sm, *batches[0], cfg, device, probe)          # warm-up: kernels, k-means init, optimizer state
    optimizer_steps(sm, stage_opts, cfg, device)
    sync(device)
    warmup_s = time.perf_counter() - t0
    passes, opts, peak = [], [], None
    for x, y in batches[1:]:
        passes.append(pipeline_pass(sm, x, y, cfg, device))
        opts.append(optimizer_steps(sm, stage_opts, cfg, device))
        if device.type == "cuda":          # the pass's ops reset the peak; what follows its last op counts too
            peak = max(peak or 0, passes[-1]["top"], torch.cuda.max_memory_allocated(device))
    timing = _stage_timing(passes, opts, P)
    comps = sm.compressors()
    timing.update({"fwd_bytes": passes[-1]["fwd_bytes"], "bwd_bytes": passes[-1]["bwd_bytes"],
                   "state_fwd_bytes": [c.sync_bytes_per_step() for c in comps],
                   "state_bwd_bytes": [c.receiver_grad_bytes_per_step() for c in comps]})
    memory = _memory_record(passes[-1], static_bytes(sm, stage_opts), P, sh["micro_batches"], peak)
    rec = _derived(item, cfg, sm, timing, sh, ctx)
    rec.update({"build_s": build_s, "warmup_s": warmup_s, "reps": len(passes), "timing": timing, "memory": memory,
                "losses": [p["loss"] for p in passes], "plan_check": plan_check(cfg, vocab, probe, device)})
    del sm, stage_opts, passes, batches
    free_device(device)
    return rec


def plan_check(cfg, vocab: int, probe: _Probe, device: torch.device) -> dict:
    """The probe against the plans, per stage: saved bytes against the memory plan's per micro-batch
    activations + head (``(activations + head) / alive``), forward and backward FLOPs against the cost
    model's, and the head recompute of a chunked loss (``2 d V`` per token, last stage, backward)."""
    plan = memory_plan(cfg, vocab, device=device.type)
    model = stage_flops(cfg, vocab)
    mc, t = cfg.model_config(vocab), cfg.train
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    chunked = 0 < t.loss_chunk_tokens < tokens
    recompute = [0] * (cfg.stages - 1) + [2 * mc.d_model * mc.vocab_size * tokens if chunked else 0]
    plan_saved = [(st.activations + st.head) // max(1, st.alive) for st in plan.stages]
    return {"precision": plan.precision, "saved_bytes": probe.saved, "plan_saved_bytes": plan_saved,
            "saved_over_plan": [m / p if p else None for m, p in zip(probe.saved, plan_saved)],
            "fwd_flops": probe.fwd_flops, "bwd_flops": probe.bwd_flops,
            "model_fwd_flops": [f["fwd"] for f in model], "model_bwd_flops": [f["bwd"] for f in model],
            "head_recompute_flops": recompute, "attention_flops_counted": device.type == "cuda"}


def _memory_record(last: dict, static: list[int], P: int, M: int, process_peak) -> dict:
    est = None
    if last["retained"][0] is not None:
        est = []
        for s in range(P):
            k = min(P - s, M)
            est.append(static[s] + max((k - 1) * last["retained"][s] + last["fwd_peak"][s],
                                       k * last["retained"][s] + last["bwd_peak"][s]))
    return {"static_bytes": static, "retained_bytes": last["retained"], "fwd_peak_bytes": last["fwd_peak"],
            "bwd_peak_bytes": last["bwd_peak"], "peak_1f1b_est_bytes": est, "process_peak_bytes": process_peak}


def _derived(item, cfg, sm, timing, sh, ctx) -> dict:
    """MFU, link-model step times and tokens/s, wire bytes per token."""
    mc, P, M = sm.model.cfg, sm.n_stages, sh["micro_batches"]
    tok_mb = sh["mb"] * sh["seq_len"]
    flops_mb = model_flops_per_token(mc, sh["seq_len"]) * tok_mb
    compute_mb = sum(timing["fwd_s"]) + sum(timing["bwd_s"])
    link = link_estimate(timing, sh["schedule"], M)
    peak = H200_PEAK_BF16
    per_link = {name: {"step_s": v["step_s"], "tokens_per_s": M * tok_mb / v["step_s"],
                       "mfu": M * flops_mb / (P * v["step_s"]) / peak, "floor_s": v["floor_s"],
                       "latency_s": v["latency_s"]} for name, v in link.items()}
    compute_step = next(iter(link.values()))["compute_s"]
    ops = timing["ops_s"]
    wire_s = sum(v for k, v in ops.items() if k.startswith(("pack", "unpack")))
    return {"model": item["model"], "method": item["method"], "ratio": item["ratio"], "stages": P,
            "d_model": mc.d_model, "rank": cfg.compressor.rank(mc.d_model), "micro_batch_tokens": tok_mb,
            "micro_batches": M, "schedule": sh["schedule"], "n_params": sum(p.numel() for p in sm.parameters()),
            "model_flops_per_token": flops_mb / tok_mb, "compute_s_per_microbatch": compute_mb,
            "wire_ops_s_per_microbatch": wire_s, "opt_s_per_step": sum(timing["opt_s"]),
            "mfu_compute": flops_mb / compute_mb / peak, "peak_flops": peak,
            "step_compute_only_s": compute_step, "links": per_link,
            "fwd_bytes_per_token": [b / tok_mb for b in timing["fwd_bytes"]],
            "bwd_bytes_per_token": [b / tok_mb for b in timing["bwd_bytes"]]}
