"""Step time of a pipeline run on a link, from compute, exact wire bytes, schedule and overlap.

A :class:`Case` is one run's step, described once: per-stage compute of a micro-batch (measured, or
FLOPs / (peak x MFU)), the bytes of every message of every boundary in each direction (asked from the
compressor objects: ``payload_spec``, ``sync_bytes_per_step``, ``receiver_grad_bytes_per_step``, plus
token ids; never a table keyed by method), the schedule and M. ``Case.step_time(link)`` replays the
step on the virtual clock of :mod:`mapl.core.link` (sends overlap compute; one FIFO channel per direction per
boundary; a step-end all-reduce), or on ProtocolNanoGPT's emulator (``channels="inbound"``: one inbound
wire per stage shared by both directions, latency occupying the wire, steps back to back)::

    >>> cfg = load_run_config("paper", {"model": "150M", "method": "mapl", "ratio": 4})
    >>> case = build_case(cfg, gpu=H100)                       # FLOP-based compute, MFU stated in H100
    >>> case.predict(get_profile("200Mbps")).step_s

FLOPs per token (forward; backward = 2x, activation checkpointing +1x of the blocks): every matmul
2 x its weights (blocks, LM head, projectors; counted on the built stage, so SSN's factored writers are
what they are), attention 4 x T x (heads x head_dim) per layer -- the full T x T score and value
products, the convention of PaLM/Megatron MFU figures (a causal flash kernel executes about half:
with MFU quoted that way the two cancel). The embedding and anchor lookups are free; RVQ search is not
in the FLOP path (measure it: issue 11 item 6). Optimizer: Muon's 5 Newton-Schulz iterations
(4 m^2 n + 2 m^3 per m x n matrix, m <= n); elementwise updates are not counted.

GPU-hours (:func:`gpu_hours`): per run, P GPUs x steps x the compute-only step (pipeline bubble and
stage imbalance included, link free) plus evaluation forwards; grid totals and wall-clock on n GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ..core.compress.base import spec_bytes
from ..core.config import config_hash, load_params, RunConfig
from ..core.link import floor_time, get_profile, IDEAL, schedule_ops, simulate, StepMeasurement
from ..core.optimizer_recipe import build_optimizers
from ..core.runtime.schedule import ONE_F_ONE_B
from ..core.stages import build_staged_model
from ..orchestration.progress import eval_tokens
from ..orchestration.groups import group_names, group_specs, spec_config

__all__ = ["GPUSpec", "H100", "H200", "DEFAULT_MFU", "StageCompute", "BoundaryBytes", "Case", "Prediction",
           "stage_flops", "flop_compute", "measured_compute", "boundary_bytes", "wire_ratio", "build_case",
           "PLANNER_SCHEDULES", "PLANNER_MICRO_BATCH_FACTORS", "with_schedule_variants",
           "simulate_inbound", "gpu_hours", "format_gpu_hours"]

DEFAULT_MFU = 0.35        # kernel-level fraction of peak while a stage computes (bubbles are modelled apart)
NS_STEPS = 5              # torch.optim.Muon's Newton-Schulz iterations


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's dense bf16 peak (FLOP/s), the MFU its kernels reach while busy, and its memory (bytes: what
    the planner's schedules must fit, ``mapl.core.memory.check_plan``)."""
    name: str
    peak_flops: float
    mfu: float = DEFAULT_MFU
    memory_bytes: float = 80e9

    def seconds(self, flops: float) -> float:
        return flops / (self.peak_flops * self.mfu)


# NVIDIA's datasheets: H100 SXM and H200 SXM, dense BF16 tensor core (the sparse figure is 2x)
H100 = GPUSpec("NVIDIA H100 SXM, dense bf16 989 TFLOP/s", 989e12)
H200 = GPUSpec("NVIDIA H200 SXM, dense bf16 989 TFLOP/s", 989e12, memory_bytes=141e9)


@dataclass(frozen=True)
class StageCompute:
    """Seconds per micro-batch of each stage (``fwd_s[s][m]``, ``bwd_s[s][m]``) and per step (``opt_s``)."""
    fwd_s: list
    bwd_s: list
    opt_s: list
    source: str


@dataclass(frozen=True)
class BoundaryBytes:
    """One boundary: bytes of one micro-batch's forward (data, piggybacked sync, token ids) and backward
    message, and of the per-step state (synced projector forward, receiver-side gradient back)."""
    fwd: float
    bwd: float
    state_fwd: float = 0.0
    state_bwd: float = 0.0


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float          # the same step on a free link: compute, bubbles, imbalance
    floor_s: float            # the busiest channel's bytes / bandwidth
    schedule: str = ""        # the schedule that step runs (the fastest of the case's variants)

    @property
    def comm_fraction(self) -> float:
        """Share of the step the link adds: 1 - compute-only / step."""
        return 1.0 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


def _payload_bytes(comp, mb_shape, direction: str) -> int:
    """Bytes of a steady-state message. A fresh compressor's next training message would be RVQ's one-off
    k-means-init message (the whole codebook, ``one_off_sync_bytes``), so the spec is read in eval mode."""
    was_training = comp.training
    comp.eval()
    try:
        spec = comp.payload_spec(mb_shape, direction)
    finally:
        comp.train(was_training)
    return spec_bytes(spec)


def _matmul_weights(module: torch.nn.Module) -> int:
    """Elements of the 2-D weights a token meets in matmuls (parameters and buffers, e.g. SSN's U)."""
    return sum(t.numel() for t in list(module.parameters()) + list(module.buffers()) if t.dim() == 2)


def _meta_model(cfg: RunConfig, vocab: int):
    """The whole StagedModel of ``cfg`` on the meta device (exact shapes, no memory) and the ids of the
    parameters Muon owns (mapl.core.optimizer_recipe.build_optimizers decides), cached per configuration."""
    key = (config_hash(cfg), vocab)
    if key not in _META:
        with torch.device("meta"):
            sm = build_staged_model(cfg, vocab)
        muon = {id(p) for o in build_optimizers(sm, cfg) if type(o).__name__ == "Muon"
                for g in o.param_groups for p in g["params"]}
        _META[key] = (sm, muon)
    return _META[key]


_META: dict = {}


def _ns_flops(params, muon: set[int]) -> float:
    total = 0.0
    for p in params:
        if id(p) in muon:
            m, n = sorted(p.shape[-2:])
            total += NS_STEPS * (4 * m * m * n + 2 * m ** 3)
    return total


def stage_flops(cfg: RunConfig, vocab_size: int | None = None, checkpointing: bool = False) -> list[dict]:
    """Per stage: forward and backward FLOPs of one micro-batch, optimizer FLOPs of one step."""
    mc = cfg.model_config(vocab_size)
    cfg = cfg.validate(mc.vocab_size)
    t = cfg.train
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    sm, muon = _meta_model(cfg, mc.vocab_size)
    out = []
    for s in range(cfg.stages):
        layers = [sm.model.layers[str(i)] for i in sm.split[s]]
        comps = [sm.boundaries[str(p)] for p in (s - 1, s) if 0 <= p < cfg.stages - 1]
        blocks = sum(2 * _matmul_weights(b) + 4 * t.seq_len * mc.n_heads * mc.head_dim for b in layers)
        other = 2 * mc.d_model * mc.vocab_size if s == cfg.stages - 1 else 0
        other += sum(2 * _matmul_weights(c) for c in comps)
        fwd = tokens * (blocks + other)
        bwd = 2 * fwd + (tokens * blocks if checkpointing else 0)
        owned = [p for b in layers for p in b.parameters()] + (list(comps[-1].parameters()) if s < cfg.stages - 1 else [])
        out.append({"fwd": fwd, "bwd": bwd, "opt": _ns_flops(owned, muon)})
    return out


def flop_compute(cfg: RunConfig, gpu: GPUSpec, vocab_size: int | None = None, checkpointing: bool = False) -> StageCompute:
    """Compute from FLOPs at ``gpu.peak_flops x gpu.mfu``."""
    fl = stage_flops(cfg, vocab_size, checkpointing)
    M = cfg.train.micro_batches
    return StageCompute([[gpu.seconds(f["fwd"])] * M for f in fl], [[gpu.seconds(f["bwd"])] * M for f in fl],
                        [gpu.seconds(f["opt"]) for f in fl],
                        f"FLOPs / ({gpu.peak_flops / 1e12:g} TFLOP/s x MFU {gpu.mfu:g}) [{gpu.name}]")


def measured_compute(timing: dict, source: str = "measured") -> StageCompute:
    """Compute measured by ``mapl pipeline``: its ``pipeline.timing`` block (or a StepMeasurement dict)."""
    return StageCompute([list(r) for r in timing["fwd_s"]], [list(r) for r in timing["bwd_s"]],
                        list(timing["opt_s"]), source)


def boundary_bytes(cfg: RunConfig, vocab_size: int | None = None) -> list[BoundaryBytes]:
    """Bytes per message of every boundary, asked from the sender's compressor object."""
    mc = cfg.model_config(vocab_size)
    cfg = cfg.validate(mc.vocab_size)
    t = cfg.train
    mb_shape = (t.batch_size // t.micro_batches, t.seq_len)
    sm, _ = _meta_model(cfg, mc.vocab_size)
    out = []
    for p in range(cfg.stages - 1):
        comp = sm.boundaries[str(p)]
        ids = sm.id_bytes_per_token() * mb_shape[0] * mb_shape[1]
        out.append(BoundaryBytes(_payload_bytes(comp, mb_shape, "fwd") + ids, _payload_bytes(comp, mb_shape, "bwd"),
                                 comp.sync_bytes_per_step(), comp.receiver_grad_bytes_per_step()))
    return out


def wire_ratio(cfg: RunConfig, vocab_size: int | None = None) -> float:
    """Compression ratio on the wire as the results report it: bf16 d per token over the forward data
    bytes per token the compressor declares (token ids and synced state apart)."""
    mc = cfg.model_config(vocab_size)
    sm, _ = _meta_model(cfg.validate(mc.vocab_size), mc.vocab_size)
    if cfg.stages < 2:
        return 1.0
    return 2 * mc.d_model / sm.boundaries["0"].wire_bytes_per_token("fwd")


@dataclass
class Case:
    """One run's step, ready to replay on any link. ``variants``: the same run under other schedules (and
    activation checkpointing) that fit the device (:func:`with_schedule_variants`); ``predict`` takes the
    fastest on each link, so the planner runs 1F1B on fast links and a deeper warm-up on slow ones."""
    name: str
    schedule: str
    compute: StageCompute
    wire: list[BoundaryBytes]
    tokens_per_step: int
    meta: dict = field(default_factory=dict)
    variants: tuple = ()

    @property
    def micro_batches(self) -> int:
        return len(self.compute.fwd_s[0])

    def step_time(self, link, channels: str = "duplex") -> float:
        return self.predict(link, channels).step_s

    def one_step_time(self, link) -> float:
        """This case's own schedule replayed for one step from an idle pipeline (its last stage's end), beside
        the steady state that ``predict`` reports: what a step costs when the one before it left no state on
        the wire."""
        return simulate(_link_measurement(self), link, steps=1).step_time

    @property
    def label(self) -> str:
        """The schedule as the planner names it (``+ checkpointing`` when blocks are recomputed; ``, M = 64``
        when the planner split the same batch into more micro-batches than the run's config)."""
        return (self.schedule + (" + checkpointing" if self.meta.get("checkpointing") else "")
                + (f", M = {self.micro_batches}" if self.meta.get("more_micro_batches") else ""))

    def predict(self, link, channels: str = "duplex") -> Prediction:
        """The step on ``link``: the fastest of this case and its ``variants`` (duplex channels; the inbound
        emulator replays this case's own schedule, as ProtocolNanoGPT's does)."""
        meas = _link_measurement(self)
        if channels == "duplex":
            own = Prediction(_link_clock(meas, link), _link_clock(meas, IDEAL), floor_time(meas, link), self.label)
            return min([own] + [v.predict(link) for v in self.variants], key=lambda p: p.step_s)
        if channels == "inbound":
            return Prediction(simulate_inbound(meas, link), simulate_inbound(meas, IDEAL), floor_time(meas, link),
                              self.label)
        raise ValueError(f"channels={channels!r} is invalid: allowed 'duplex', 'inbound'")

    def with_compute(self, compute: StageCompute) -> "Case":
        return replace(self, compute=compute)

    def scaled(self, k: float) -> "Case":
        """The same case with every compute time x k (e.g. another MFU: k = mfu / mfu'), variants too."""
        c = self.compute
        return replace(self, compute=StageCompute([[x * k for x in r] for r in c.fwd_s], [[x * k for x in r] for r in c.bwd_s],
                                                  [x * k for x in c.opt_s], f"{c.source} x {k:g}"),
                       variants=tuple(v.scaled(k) for v in self.variants))


def _link_measurement(case: Case):
    """The adapter to mapl.core.link (the runtime's virtual clock): a Case as a StepMeasurement."""
    w = case.wire
    return StepMeasurement(case.schedule, case.compute.fwd_s, case.compute.bwd_s, [b.fwd for b in w],
                           [b.bwd for b in w], case.compute.opt_s, [b.state_fwd for b in w],
                           [b.state_bwd for b in w], collective=True)


def _link_clock(meas, link) -> float:
    return simulate(meas, link).step_time


def build_case(cfg: RunConfig, compute: StageCompute | None = None, gpu: GPUSpec = H100,
               vocab_size: int | None = None, name: str | None = None, checkpointing: bool = False) -> Case:
    """A Case for ``cfg``: wire bytes from its compressors; compute given, else from FLOPs on ``gpu``."""
    t = cfg.train
    comp = compute or flop_compute(cfg, gpu, vocab_size, checkpointing)
    return Case(name or cfg.name(), t.schedule, comp, boundary_bytes(cfg, vocab_size), t.batch_size * t.seq_len,
                {"method": cfg.compressor.method, "ratio": cfg.compressor.ratio, "stages": cfg.stages,
                 "checkpointing": checkpointing})


# the schedules the planner weighs: the 1F1B family, shallowest first (each holds more micro-batches than the one before)
PLANNER_SCHEDULES = ONE_F_ONE_B
# ...and the micro-batch counts, as multiples of the config's M: the same batch in k times as many micro-batches
# shortens the pipeline's fill and drain against the link's floor ((M + 2P - 3) / M when compute is free). It is
# the same step up to the order of the float sums (not bit-identical to the config's M, unlike a schedule).
PLANNER_MICRO_BATCH_FACTORS = (1, 2)


def with_schedule_variants(case: Case, cfg: RunConfig, gpu: GPUSpec, vocab_size: int | None = None,
                           schedules: Sequence[str] = PLANNER_SCHEDULES,
                           micro_batch_factors: Sequence[int] = (1,)) -> Case:
    """``case`` with a variant for every schedule of ``schedules`` (with and without activation checkpointing)
    whose memory plan fits ``gpu.memory_bytes`` (``mapl.core.memory.check_plan``, its reserve included): the
    planner's choice of schedule. Deeper warm-ups hold more graphs, so each checkpointing setting stops at
    the first schedule that does not fit. ``micro_batch_factors``: also the same batch in k x M micro-batches
    (each k that divides the batch; :data:`PLANNER_MICRO_BATCH_FACTORS` is the planner's)."""
    from ..core.memory import check_plan, memory_plan          # torch-heavy: only when variants are asked for
    variants = []
    M, batch = cfg.train.micro_batches, cfg.train.batch_size
    for k in micro_batch_factors:
        if k < 1 or batch % (k * M):
            continue
        more = replace(cfg, train=replace(cfg.train, micro_batches=k * M))
        for ckpt in (False, True):
            for name in schedules:
                var = replace(more, train=replace(more.train, schedule=name))
                try:
                    check_plan(memory_plan(var, vocab_size, device="cuda", checkpointing=ckpt), gpu.memory_bytes)
                except ValueError:
                    break
                if (name, ckpt, k) != (case.schedule, bool(case.meta.get("checkpointing")), 1):
                    variant = build_case(var, gpu=gpu, vocab_size=vocab_size, name=case.name, checkpointing=ckpt)
                    variant.meta["more_micro_batches"] = k > 1
                    variants.append(variant)
    return replace(case, variants=tuple(variants))


def simulate_inbound(meas, link, steps: int = 4) -> float:
    """Steady-state step time under ProtocolNanoGPT's emulator (its ``SimPipelineStage``): each stage has
    ONE inbound wire carrying the forward messages from s-1 and the gradients from s+1 in the order the
    stage consumes them; a message holds the wire for bytes/bandwidth + latency
    (``arrives = max(wire free, sent) + bits/bw + latency``); compute is synchronous; steps follow each
    other without a barrier (a stage starts step k+1 after its own optimizer step of step k) and there
    is no step-end all-reduce or state sync. Returns the mean step time after the first of ``steps``."""
    link = get_profile(link)
    P, M = meas.n_stages, meas.n_micro
    ops = [[(k, m, i) for i in range(steps) for k, m in schedule_ops(meas.schedule, P, M, s) + [("O", -1)]]
           for s in range(P)]
    pos, free, wire = [0] * P, [0.0] * P, [0.0] * P
    sent = {}                        # (stage, "F"/"B", m, step) -> end time of the op that sends
    step_end = [[0.0] * steps for _ in range(P)]
    remaining = sum(map(len, ops))
    while remaining:
        progressed = False
        for s in range(P):
            while pos[s] < len(ops[s]):
                kind, m, i = ops[s][pos[s]]
                ready = free[s]
                src = (s - 1, "F") if kind == "F" and s > 0 else (s + 1, "B") if kind == "B" and s < P - 1 else None
                if src is not None:
                    key = (*src, m, i)
                    if key not in sent:
                        break
                    nbytes = meas.fwd_bytes[s - 1] if kind == "F" else meas.bwd_bytes[s]
                    wire[s] = max(wire[s], sent[key]) + link.transfer_s(nbytes) + link.latency_s
                    ready = max(ready, wire[s])
                dur = meas.fwd_s[s][m] if kind == "F" else meas.bwd_s[s][m] if kind == "B" else meas.opt_s[s]
                free[s] = ready + dur
                if kind == "O":
                    step_end[s][i] = free[s]
                else:
                    sent[(s, kind, m, i)] = free[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks in the inbound-wire clock (a bug)")
    ends = [max(step_end[s][i] for s in range(P)) for i in range(steps)]
    return (ends[-1] - ends[0]) / (steps - 1) if steps > 1 else ends[0]


# ---- GPU-hours of a profile -----------------------------------------------------------------------
def _compute_only_case(cfg: RunConfig, gpu: GPUSpec, cache: dict) -> Case:
    t, c = cfg.train, cfg.compressor
    key = (cfg.model, tuple(sorted(cfg.model_overrides.items())), cfg.stages, c.method, c.ratio, c.projector,
           c.anchor, t.batch_size, t.micro_batches, t.seq_len, cfg.data.vocab_size)
    if key not in cache:
        comp = flop_compute(cfg, gpu, cfg.data.vocab_size)
        cache[key] = Case(cfg.name(), "1f1b", comp, [BoundaryBytes(0, 0)] * (cfg.stages - 1), t.batch_size * t.seq_len)
    return cache[key]


def _run_hours(cfg: RunConfig, gpu: GPUSpec, cache: dict) -> dict:
    t = cfg.train
    case = _compute_only_case(cfg, gpu, cache)
    step_s = case.predict(IDEAL).compute_s
    mb_tokens = (t.batch_size // t.micro_batches) * t.seq_len
    # evaluation: forward only through the pipeline, every eval_every steps and at the end
    evals = t.steps // t.eval_every + (1 if t.steps % t.eval_every else 0)
    eval_s = (eval_tokens(cfg) / mb_tokens) * max(r[0] for r in case.compute.fwd_s)
    run_s = t.steps * step_s + evals * eval_s
    return {"run": cfg.name(), "model": cfg.model, "stages": cfg.stages, "method": cfg.compressor.method,
            "steps": t.steps, "tokens": t.steps * t.batch_size * t.seq_len, "step_s": step_s, "eval_s": evals * eval_s,
            "run_s": run_s, "gpu_hours": cfg.stages * run_s / 3600}


def _wall_clock(runs: Sequence[dict], n_gpus: int) -> float:
    """Makespan (s) of the runs on ``n_gpus``, each run on its P GPUs, longest first (list scheduling)."""
    queue = sorted(runs, key=lambda r: -r["run_s"])
    if any(r["stages"] > n_gpus for r in queue):
        return math.inf
    t, free, running = 0.0, n_gpus, []          # running: (finish time, gpus)
    while queue:
        fit = next((r for r in queue if r["stages"] <= free), None)
        if fit is None:
            running.sort()
            end, g = running.pop(0)
            t, free = end, free + g
            continue
        queue.remove(fit)
        running.append((t + fit["run_s"], fit["stages"]))
        free -= fit["stages"]
    return max([t] + [e for e, _ in running])


def gpu_hours(profile: str = "paper", gpu: GPUSpec = H100, groups: Sequence[str] | None = None,
              n_gpus: Sequence[int] = (8, 64), params: dict | None = None) -> dict:
    """GPU-hours of every run of ``profile``'s groups (default all), totals and wall-clock on ``n_gpus``.
    Runs use 1F1B (GPipe does not fit paper micro-batches: mapl.core.memory); the link inside a node is free."""
    params = params or load_params()
    groups = list(groups or group_names(profile, params))
    cache, rows = {}, []
    for g in groups:
        for spec in group_specs(profile, g, params):
            cfg = spec_config(profile, spec, params)
            cfg = replace(cfg, train=replace(cfg.train, schedule="1f1b"))
            rows.append({"group": g, **_run_hours(cfg, gpu, cache)})
    total = sum(r["gpu_hours"] for r in rows)
    return {"profile": profile, "gpu": gpu.name, "peak_flops": gpu.peak_flops, "mfu": gpu.mfu, "runs": rows,
            "total_gpu_hours": total,
            "wall_clock_h": {n: {"list_scheduled": _wall_clock(rows, n) / 3600, "ideal": total / n} for n in n_gpus}}


def format_gpu_hours(rep: dict) -> str:
    """The estimate as text: assumptions, one row per run, totals and wall-clock."""
    lines = [f"GPU-hour estimate for profile {rep['profile']!r}: {rep['gpu']}, MFU {rep['mfu']:g} while a stage "
             f"computes (stated assumption); FLOPs count attention (4 T d_attn per token per layer, forward) "
             f"and the LM head; 1F1B bubble and stage imbalance from the virtual clock; link free; evaluation "
             f"forwards included.", "",
             "| group | run | P | steps | tokens (B) | step (s) | GPU-hours |", "|---|---|---|---|---|---|---|"]
    for r in rep["runs"]:
        lines.append(f"| {r['group']} | {r['run']} | {r['stages']} | {r['steps']} | {r['tokens'] / 1e9:.2f} | "
                     f"{r['step_s']:.2f} | {r['gpu_hours']:.1f} |")
    lines += ["", f"Total: {rep['total_gpu_hours']:.0f} GPU-hours ({len(rep['runs'])} runs)."]
    for n, w in rep["wall_clock_h"].items():
        lines.append(f"On {n} GPUs: {w['list_scheduled']:.1f} h wall-clock with each run on its P GPUs (longest "
                     f"first); {w['ideal']:.1f} h if data-parallel replicas keep every GPU busy.")
    return "\n".join(lines) + "\n"

