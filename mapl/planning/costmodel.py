"""Step time of a pipeline run on a link, from compute, exact wire bytes, schedule and overlap; GPU-hours.

A :class:`Case` is one run's step, replayed on mapl.core.link's virtual clock; docs/pipeline.md says what it counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..core.compress.base import spec_bytes
from ..core.config import config_hash, load_params, RunConfig
from ..core.link import floor_time, IDEAL, simulate, StepMeasurement
from ..core.optimizer_recipe import build_optimizers
from ..core.schedule import ONE_F_ONE_B
from ..core.stages import build_staged_model
from ..orchestration.progress import eval_tokens
from ..orchestration.groups import group_names, group_specs, spec_config

__all__ = ["GPUSpec", "H100", "H200", "DEFAULT_MFU", "StageCompute", "BoundaryBytes", "Case", "Prediction",
           "stage_flops", "flop_compute", "measured_compute", "boundary_bytes", "wire_ratio", "build_case",
           "PLANNER_SCHEDULES", "PLANNER_MICRO_BATCH_FACTORS", "with_schedule_variants",
           "gpu_hours", "format_gpu_hours"]

DEFAULT_MFU = 0.35        # kernel-level fraction of peak while a stage computes (bubbles are modelled apart)
NS_STEPS = 5              # torch.optim.Muon's Newton-Schulz iterations


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's dense bf16 peak (FLOP/s), the MFU its kernels reach while busy, and its memory (bytes)."""
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
    """One boundary's bytes: a micro-batch's forward and backward message, and the per-step state each way."""
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
    """Bytes of a steady-state message (in eval mode: a fresh RVQ's next training message is its k-means init)."""
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
    """The StagedModel of ``cfg`` on the meta device and the ids of the parameters Muon owns, cached."""
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
    """Muon's Newton-Schulz FLOPs of one step: 4 m^2 n + 2 m^3 per iteration and m x n matrix it owns (m <= n)."""
    shapes = [sorted(p.shape[-2:]) for p in params if id(p) in muon]
    return sum((NS_STEPS * (4 * m * m * n + 2 * m ** 3) for m, n in shapes), 0.0)


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
    """Bytes per message of every boundary, asked from the sender's compressor."""
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
    """Compression ratio on the wire as the results report it: bf16 d over the forward data bytes per token."""
    mc = cfg.model_config(vocab_size)
    sm, _ = _meta_model(cfg.validate(mc.vocab_size), mc.vocab_size)
    if cfg.stages < 2:
        return 1.0
    return 2 * mc.d_model / sm.boundaries["0"].wire_bytes_per_token("fwd")


@dataclass(frozen=True)
class Case:
    """One run's step, ready to replay on any link; ``predict`` takes the fastest of it and its ``variants``
    (other schedules that fit the device: :func:`with_schedule_variants`)."""
    schedule: str
    compute: StageCompute
    wire: list[BoundaryBytes]
    checkpointing: bool = False           # blocks recomputed in backward
    more_micro_batches: bool = False      # the planner split the batch into more micro-batches than the config's
    variants: tuple = ()

    @property
    def micro_batches(self) -> int:
        return len(self.compute.fwd_s[0])

    def step_time(self, link) -> float:
        return self.predict(link).step_s

    def one_step_time(self, link) -> float:
        """This case's own schedule for one step from an idle pipeline (``predict`` is the steady state)."""
        return simulate(_link_measurement(self), link, steps=1).step_time

    @property
    def label(self) -> str:
        """The schedule as the planner names it, e.g. '1f1b-x2 + checkpointing, M = 64'."""
        return (self.schedule + (" + checkpointing" if self.checkpointing else "")
                + (f", M = {self.micro_batches}" if self.more_micro_batches else ""))

    def predict(self, link) -> Prediction:
        """The step on ``link``: the fastest of this case and its variants."""
        meas = _link_measurement(self)
        own = Prediction(simulate(meas, link).step_time, simulate(meas, IDEAL).step_time, floor_time(meas, link),
                         self.label)
        return min([own] + [v.predict(link) for v in self.variants], key=lambda p: p.step_s)

    def scaled(self, k: float) -> "Case":
        """Every compute time x k (another MFU: k = mfu / mfu'), variants too."""
        c = self.compute
        return replace(self, compute=StageCompute([[x * k for x in r] for r in c.fwd_s], [[x * k for x in r] for r in c.bwd_s],
                                                  [x * k for x in c.opt_s], f"{c.source} x {k:g}"),
                       variants=tuple(v.scaled(k) for v in self.variants))


def _link_measurement(case: Case):
    """A Case as mapl.core.link's StepMeasurement (the runtime's virtual clock)."""
    w = case.wire
    return StepMeasurement(case.schedule, case.compute.fwd_s, case.compute.bwd_s, [b.fwd for b in w],
                           [b.bwd for b in w], case.compute.opt_s, [b.state_fwd for b in w],
                           [b.state_bwd for b in w], collective=True)


def build_case(cfg: RunConfig, compute: StageCompute | None = None, gpu: GPUSpec = H100,
               vocab_size: int | None = None, checkpointing: bool = False) -> Case:
    """A Case for ``cfg``: wire bytes from its compressors; compute given, else from FLOPs on ``gpu``."""
    return Case(cfg.train.schedule, compute or flop_compute(cfg, gpu, vocab_size, checkpointing),
                boundary_bytes(cfg, vocab_size), checkpointing)


# the schedules the planner weighs: the 1F1B family, shallowest first (each holds more micro-batches than the one before)
PLANNER_SCHEDULES = ONE_F_ONE_B
# ...and the micro-batch counts, as multiples of the config's M: the same batch in k times as many micro-batches
# shortens the pipeline's fill and drain against the link's floor ((M + 2P - 3) / M when compute is free). It is
# the same step up to the order of the float sums (not bit-identical to the config's M, unlike a schedule).
PLANNER_MICRO_BATCH_FACTORS = (1, 2)


def with_schedule_variants(case: Case, cfg: RunConfig, gpu: GPUSpec, vocab_size: int | None = None,
                           schedules: Sequence[str] = PLANNER_SCHEDULES,
                           micro_batch_factors: Sequence[int] = (1,)) -> Case:
    """``case`` with a variant per schedule, checkpointing and micro-batch factor whose memory plan fits the GPU
    (schedules shallowest first: each setting stops at the first that does not fit)."""
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
                if (name, ckpt, k) != (case.schedule, case.checkpointing, 1):
                    variant = build_case(var, gpu=gpu, vocab_size=vocab_size, checkpointing=ckpt)
                    variants.append(replace(variant, more_micro_batches=k > 1))
    return replace(case, variants=tuple(variants))


# ---- GPU-hours of a profile -----------------------------------------------------------------------
def _run_hours(cfg: RunConfig, gpu: GPUSpec, cache: dict) -> dict:
    """One run's GPU-hours: P GPUs x (steps x the compute-only 1F1B step + evaluation forwards)."""
    t, c = cfg.train, cfg.compressor
    key = (cfg.model, tuple(sorted(cfg.model_overrides.items())), cfg.stages, c.method, c.ratio, c.projector,
           c.anchor, t.batch_size, t.micro_batches, t.seq_len, cfg.data.vocab_size)
    if key not in cache:            # the step's compute is shared by runs that differ in steps, seed, rates
        cache[key] = Case("1f1b", flop_compute(cfg, gpu, cfg.data.vocab_size), [BoundaryBytes(0, 0)] * (cfg.stages - 1))
    case = cache[key]
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
    """GPU-hours of every run of ``profile``'s groups, totals and wall-clock on ``n_gpus`` (1F1B, a free link)."""
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

