"""Side by side with PyTorch's own pipeline engine: our runtime against ``torch.distributed.pipelining``.

Writes: ``reports/bench/peer-pipelining.json``, ``reports/tables/peer-pipelining.md``.

The same model split into the same stages (our ``StagedModel`` stage modules), the same initial weights
and the same micro-batches, trained by (a) our runtime (``mapl.core.runtime.worker.PipelineEngine``) and
(b) ``torch.distributed.pipelining`` (``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``), on
gloo, CPU, P = 2 and 4, M = 4 and 8. Both engines live in the same P processes and take turns step by
step (which one goes first alternates), so they see the same machine load; every step starts at a
barrier. Per step: the loss, each stage's gradient norm (before clipping) and the step time (the
slowest rank's, barrier to end of the optimizer step).

    python benchmarks/peer_pipelining.py                  # 2 methods x 8 cells, 24 steps: ~8 min on 2 busy cores
    python benchmarks/peer_pipelining.py --methods none --stages 2 --micro 4 --schedules gpipe --steps 4

What the library side is made of. ``PipelineStage`` wraps our stage module; the boundary's wire is
two autograd functions around the compressor's own ``pack``/``unpack`` (forward) and
``pack_grad``/``unpack_grad`` (backward), so the library moves exactly the tensors our transport moves:
bf16 activations for ``none``, bf16 Z (r wide) plus 16-bit token ids for MAPL, and a bf16 gradient of
Z's shape back. Stage metadata is given statically, so the library never runs a stage on
uninitialised buffers. The loss is the micro-batch mean / M with ``scale_grads=False`` (our runtime's
loss scaling; dividing the summed gradients by M afterwards, the library's default, gives the same bits
only when M is a power of two). What
happens once per step after the schedule (receiver-side projector gradient back, one all-reduce for
the loss and global clipping, the optimizer step, the projector forward) is not the library's job in
either engine: the library side ends its steps with ``PipelineEngine.finish_step`` of a second
engine, built only as the holder of the library's copy of the stage (model, optimizers, agreement).

What the library cannot carry, and why (``library_refusal``): it sends each stage output forward and
sends back, for each floating-point output, a gradient of exactly that output's shape and dtype; an
integer output gets no gradient. int8 (int8 codes + fp16 scales, the same back) and MAPL+RVQ
(bit-packed codes + a codebook slice forward, an r-wide bf16 gradient back) do not fit that rule.

Writes ``reports/bench/peer-pipelining.json`` and ``reports/tables/peer-pipelining.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mapl.core.compress import build_boundary
from mapl.core.config import load_run_config
from mapl.core.engine import autocast_ctx, open_run_data, set_lr
from mapl.base.io import atomic_write_json, atomic_write_text
from mapl.core.loop import lr_factor
from mapl.orchestration.launch import child_env, free_port
from mapl.core.runtime.topology import Topology
from mapl.core.runtime.transport import Transport
from mapl.core.runtime.worker import PipelineEngine
from mapl.report.stats import t_interval, t_quantile

METHODS = {"none": 1.0, "mapl": 8.0}
REFUSED = {"int8": 1.0, "mapl-rvq": 4.0}         # checked for the note, never trained here
TIMEOUT_S = 120.0


# ---- what the library can put on the wire ---------------------------------------------------------
def library_refusal(comp, lead: tuple[int, int]) -> str | None:
    """None when ``torch.distributed.pipelining`` can carry this boundary's messages as they are, else
    why not. The library's rule: every stage output goes forward as a tensor; for every floating-point
    output exactly one gradient of the same shape and dtype comes back; integer outputs get none."""
    fwd, bwd = comp.payload_spec(lead, "fwd"), comp.payload_spec(lead, "bwd")
    ints = [i for i, (_, dt) in enumerate(fwd) if not dt.is_floating_point]
    if ints:
        return (f"forward message {_specs(fwd)} holds integer tensor(s) {ints}, which get no gradient, while the "
                f"gradient message is {_specs(bwd)}: the float activation would have to cross the wire as well")
    if fwd != bwd:
        return (f"forward message {_specs(fwd)} and gradient message {_specs(bwd)} differ; the library sends back "
                f"a gradient of each output's own shape and dtype")
    return None


def _specs(specs) -> str:
    return "[" + ", ".join(f"{str(dt).removeprefix('torch.')}{list(shape)}" for shape, dt in specs) + "]"


class _ToWire(torch.autograd.Function):
    """Sender side of a boundary: the stage output becomes its forward message (``pack``); the message's
    gradient, as the library delivers it, becomes dL/d(output) (``unpack_grad``)."""

    @staticmethod
    def forward(ctx, out, comp):
        ctx.comp, ctx.dtype = comp, out.dtype
        (payload,) = comp.pack(out)
        return payload

    @staticmethod
    def backward(ctx, g):
        return ctx.comp.unpack_grad([g], ctx.dtype), None


class _FromWire(torch.autograd.Function):
    """Receiver side: the received message becomes the stage input (``unpack``); the input's gradient
    becomes the gradient message the library sends back (``pack_grad``)."""

    @staticmethod
    def forward(ctx, payload, comp, dtype):
        ctx.comp = comp
        return comp.unpack([payload], dtype)

    @staticmethod
    def backward(ctx, g):
        (payload,) = ctx.comp.pack_grad(g)
        return payload, None, None


class LibraryStageModule(nn.Module):
    """Our stage ``s`` as the library sees it: inputs (message[, token ids]) -> (message[, token ids]), or
    logits on the last stage. The stage itself is ``StagedModel.stage_forward``, unchanged."""

    def __init__(self, sm, stage: int, cfg, device: torch.device, in_dtype: torch.dtype):
        super().__init__()
        self.sm, self.stage, self.cfg, self.device, self.in_dtype = sm, stage, cfg, device, in_dtype
        self.first, self.last = stage == 0, stage == sm.n_stages - 1

    def forward(self, *inputs):
        z_in, ids = None, None
        if self.first:
            ids = inputs[0]
        else:
            z_in = _FromWire.apply(inputs[0], self.sm.boundaries[str(self.stage - 1)], self.in_dtype)
            if self.sm.ids_on_wire:
                ids = _widen_ids(inputs[1], self.sm.id_dtype)
        with autocast_ctx(self.cfg, self.device):
            out = self.sm.stage_forward(self.stage, z_in, ids)
        if self.last:
            return out
        msg = _ToWire.apply(out, self.sm.boundaries[str(self.stage)])
        return (msg, ids.to(self.sm.id_dtype)) if self.sm.ids_on_wire else msg


def _widen_ids(wire_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit ids carry the uint16 bit pattern in an int16 tensor (as mapl.core.runtime.messages reads them)."""
    ids = wire_ids.to(torch.int64)
    return ids & 0xFFFF if dtype == torch.int16 else ids


def _static_metas(holder: PipelineEngine, mb: int, T: int, vocab: int):
    """Example tensors of one micro-batch's inputs and outputs (the library then infers nothing)."""
    sm, s, P = holder.sm, holder.stage, holder.P

    def message(comp):
        ((shape, dt),) = comp.payload_spec((mb, T), "fwd")
        parts = [torch.empty(shape, dtype=dt).requires_grad_(True)]
        return parts + ([torch.empty((mb, T), dtype=sm.id_dtype)] if sm.ids_on_wire else [])

    inputs = [torch.empty((mb, T), dtype=torch.int64)] if s == 0 else message(holder.comp_in)
    outputs = [torch.empty((mb, T, vocab), dtype=torch.float32).requires_grad_(True)] if s == P - 1 \
        else message(holder.comp_out)
    return tuple(inputs), tuple(outputs)


class LibraryPipeline:
    """One stage trained by ``torch.distributed.pipelining``; ``train_step`` returns the global loss."""

    def __init__(self, holder: PipelineEngine, cfg, group):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.h, self.cfg = holder, cfg
        t = cfg.train
        for comp in (holder.comp_in, holder.comp_out):
            why = comp is not None and library_refusal(comp, (holder.mb_size, t.seq_len))
            if why:
                raise ValueError(f"compressor.method={cfg.compressor.method!r}: torch.distributed.pipelining "
                                 f"cannot carry this boundary: {why}")
        vocab = holder.model_cfg.vocab_size
        module = LibraryStageModule(holder.sm, holder.stage, cfg, holder.topo.device, torch.float32)
        ins, outs = _static_metas(holder, holder.mb_size, t.seq_len, vocab)
        stage = PipelineStage(module, holder.stage, holder.P, holder.topo.device, input_args=ins, output_args=outs,
                              group=group)
        M = holder.M

        def loss_fn(logits, y):     # the runtime's loss: micro-batch mean / M (scale_grads=False below)
            return F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1)) / M
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[t.schedule]
        self.schedule = kind(stage, M, loss_fn=loss_fn, scale_grads=False)

    def train_step(self, step: int, lr_scale: float) -> float:
        h = self.h
        set_lr(h.opts, lr_scale)
        x, y = h.data.batch(step, self.cfg.train)
        losses: list = []
        if h.topo.first:
            self.schedule.step(x, return_outputs=False)
        elif h.topo.last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for loss in losses:                              # micro-batch order, as the runtime sums them
            loss_sum += loss.detach()
        no = torch.zeros((), dtype=torch.bool)
        return h.finish_step(step, loss_sum, no, no).loss


class _NormTap:
    """Stands in for an engine's ``agreement``: the step reads its gradients there, after every backward
    (and the receiver-side projector gradient) and before clipping; the tap notes this stage's norm."""

    def __init__(self, agreement):
        self.inner, self.norm = agreement, None

    def vector(self, *args, **kwargs):
        grads = [p.grad for _, p in self.inner.owned if p.grad is not None]
        self.norm = float(torch.stack([n.double() for n in torch._foreach_norm(grads)]).norm()) if grads else 0.0
        return self.inner.vector(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ---- one rank ----------------------------------------------------------------------------------------
def _time_finish_step(engine: PipelineEngine) -> list[float]:
    """Note when ``engine`` enters ``finish_step`` (after the schedule: the loss all-reduce, clipping and the
    optimizer step, the same code for both engines). Barrier to that moment is the engines' own part of a step:
    the shared optimizer (bf16 Newton-Schulz, about two thirds of a CPU step) would otherwise hide it."""
    stamps: list[float] = []
    inner = engine.finish_step

    def timed(*args, **kwargs):
        stamps.append(time.perf_counter())
        return inner(*args, **kwargs)
    engine.finish_step = timed
    return stamps


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def run_cell(cfg, rank: int, world: int, steps: int, data) -> dict:
    """Both engines on this rank for ``steps`` steps, alternating; rank 0 returns every rank's records."""
    dev = torch.device("cpu")
    topo = Topology(rank, world, cfg.stages, dev, "gloo", "env")
    tmo = timedelta(seconds=TIMEOUT_S)
    world_group = dist.new_group(timeout=tmo)

    def engine() -> PipelineEngine:
        tx = Transport(rank, topo.prev, topo.next, dev, TIMEOUT_S, world_group=world_group, stages=topo.stages)
        return PipelineEngine(cfg, topo, data, tx, None, None, lambda *a, **k: None, {})
    ours, holder = engine(), engine()
    same_init = _same_state(ours.sm, holder.sm)
    lib = LibraryPipeline(holder, cfg, dist.new_group(timeout=tmo))
    taps = {"ours": _NormTap(ours.agreement), "library": _NormTap(holder.agreement)}
    ours.agreement, holder.agreement = taps["ours"], taps["library"]
    run = {"ours": lambda k, lr: ours.train_step(k, lr).loss, "library": lib.train_step}
    rec = {name: {"loss": [], "grad_norm": [], "time_s": [], "schedule_s": []} for name in run}
    entered = {}
    for name, eng in (("ours", ours), ("library", holder)):
        entered[name] = _time_finish_step(eng)
    for k in range(steps):
        lr = lr_factor(k, cfg)
        for name in (("ours", "library") if k % 2 == 0 else ("library", "ours")):
            dist.barrier(group=world_group)
            t0 = time.perf_counter()
            loss = run[name](k, lr)
            rec[name]["time_s"].append(time.perf_counter() - t0)
            rec[name]["schedule_s"].append(entered[name][-1] - t0)
            rec[name]["loss"].append(loss)
            rec[name]["grad_norm"].append(taps[name].norm)
    mine = {"stage": topo.stage, "same_initial_weights": same_init, **rec}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=world_group)
    return everyone if rank == 0 else None


def _worker(spec_path: str) -> None:
    spec = pickle.loads(Path(spec_path).read_bytes())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    torch.set_num_threads(1)
    data = open_run_data(spec["cfgs"][0])
    cells = []
    for cfg in spec["cfgs"]:
        cells.append(run_cell(cfg.validate(data.vocab_size), rank, world, spec["steps"], data))
    if rank == 0:
        atomic_write_json(Path(spec["out"]), {"cells": cells})
    dist.destroy_process_group()


# ---- orchestration ---------------------------------------------------------------------------------------
def run_group(cfgs: list, steps: int, timeout_s: float = 900.0) -> list[list[dict]]:
    """Run every config of ``cfgs`` (same method and P) in one set of P processes; per config, every
    rank's records."""
    P = cfgs[0].stages
    with tempfile.TemporaryDirectory(prefix="mapl-peer-pp-") as tmp:
        spec, out = Path(tmp) / "spec.pkl", Path(tmp) / "out.json"
        spec.write_bytes(pickle.dumps({"cfgs": cfgs, "steps": steps, "out": str(out)}))
        port = free_port()
        procs = []
        for r in range(P):
            env = child_env({"RANK": str(r), "WORLD_SIZE": str(P), "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)],
                                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        t0 = time.time()
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, timeout_s - (time.time() - t0))))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate())
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tails = "\n".join(f"[rank {r}] {outs[r][1][-2000:]}" for r, _ in failed)
            raise RuntimeError(f"peer_pipelining ranks failed {failed}:\n{tails}")
        return json.loads(out.read_text())["cells"]


def summarize(cfg, ranks: list[dict], warmup: int) -> dict:
    """One cell: losses of both engines, per-stage gradient norms, median step time and the ratio."""
    ranks = sorted(ranks, key=lambda r: r["stage"])
    cell = {"method": cfg.compressor.method, "ratio": cfg.compressor.ratio, "schedule": cfg.train.schedule,
            "stages": cfg.stages, "micro_batches": cfg.train.micro_batches,
            "same_initial_weights": all(r["same_initial_weights"] for r in ranks)}
    for name in ("ours", "library"):
        step_s = [max(r[name]["time_s"][k] for r in ranks) for k in range(len(ranks[0][name]["time_s"]))]
        cell[name] = {"loss": ranks[0][name]["loss"], "grad_norm_per_stage": [r[name]["grad_norm"] for r in ranks],
                      "step_s": step_s, "median_step_s": statistics.median(step_s[warmup:])}
    a, b = cell["ours"], cell["library"]
    cell["loss_bit_identical"] = a["loss"] == b["loss"]
    cell["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a["loss"], b["loss"]))
    cell["grad_norm_bit_identical"] = a["grad_norm_per_stage"] == b["grad_norm_per_stage"]
    cell["grad_norm_max_rel_diff"] = max(abs(x - y) / max(abs(y), 1e-30)
                                         for sa, sb in zip(a["grad_norm_per_stage"], b["grad_norm_per_stage"])
                                         for x, y in zip(sa, sb))
    cell["step_time_ratio"] = a["median_step_s"] / b["median_step_s"]
    # steps k of the two engines ran back to back, so their ratio cancels most of the load drift of a
    # shared machine; the fastest steps estimate each engine's uncontended cost
    paired = [x / y for x, y in zip(a["step_s"][warmup:], b["step_s"][warmup:])]
    q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    cell["paired_ratio"] = {"median": statistics.median(paired), "q1": q1, "q3": q3}
    cell["fastest_ratio"] = min(a["step_s"][warmup:]) / min(b["step_s"][warmup:])
    sched = {name: [max(r[name]["schedule_s"][k] for r in ranks) for k in range(len(ranks[0][name]["schedule_s"]))]
             for name in ("ours", "library")}
    cell["schedule_only"] = ratio_interval(sched["ours"][warmup:], sched["library"][warmup:])
    cell["schedule_only"].update(ours_median_s=statistics.median(sched["ours"][warmup:]),
                                 library_median_s=statistics.median(sched["library"][warmup:]))
    return cell


Z_POWER_80 = 0.8416          # the standard normal's 0.8 quantile: 80 % power


def ratio_interval(ours: list[float], library: list[float], level: float = 0.95) -> dict:
    """The ratio ours / library as the geometric mean of the paired step ratios (steps run back to back), its
    t interval, and the smallest difference this many steps would detect with 80 % power at that level
    (``mde``: two-sided, on the log scale): ``resolves_5pct`` when it is at most 5 %."""
    logs = [math.log(x / y) for x, y in zip(ours, library)]
    n = len(logs)
    lo, hi = t_interval(logs, level) if n > 1 else (float("nan"), float("nan"))
    se = statistics.stdev(logs) / math.sqrt(n) if n > 1 else float("nan")
    mde = math.exp((t_quantile(0.5 + level / 2, n - 1) + Z_POWER_80) * se) - 1 if n > 1 else float("nan")
    return {"n": n, "ratio": math.exp(statistics.fmean(logs)), "ci": [math.exp(lo), math.exp(hi)], "level": level,
            "mde": mde, "resolves_5pct": bool(mde <= 0.05)}


def pooled_ratio(cells: list[dict], level: float = 0.95) -> dict | None:
    """Over cells (each a :func:`ratio_interval`): the geometric mean of their ratios with a t interval across
    cells (the cells' spread, not the steps', is what a claim about the engines must survive)."""
    logs = [math.log(c["ratio"]) for c in cells]
    if len(logs) < 2:
        return None
    lo, hi = t_interval(logs, level)
    return {"cells": len(logs), "ratio": math.exp(statistics.fmean(logs)), "ci": [math.exp(lo), math.exp(hi)],
            "level": level}


def cell_configs(profile: str, method: str, P: int, schedules, micro, overrides: dict | None = None) -> list:
    over = {"method": method, "stages": P, "train.threads": 1, **(overrides or {})}
    if method != "none":
        over["ratio"] = (METHODS | REFUSED)[method]
    return [load_run_config(profile, {**over, "train.schedule": s, "train.micro_batches": m})
            for s in schedules for m in micro]


def boundary_messages(profile: str) -> dict:
    """For the note: each compressed method's messages at one boundary (one micro-batch of the profile's
    default M) and whether the library can carry them."""
    out = {}
    for method, ratio in {**{m: r for m, r in METHODS.items() if m != "none"}, **REFUSED}.items():
        cfg = load_run_config(profile, {"method": method, "ratio": ratio})
        d = cfg.model_config().d_model
        comp = build_boundary(cfg.compressor.validate(d), d, 0)
        lead = (cfg.train.batch_size // cfg.train.micro_batches, cfg.train.seq_len)
        out[method] = {"ratio": ratio, "fwd": _specs(comp.payload_spec(lead, "fwd")),
                       "bwd": _specs(comp.payload_spec(lead, "bwd")), "refusal": library_refusal(comp, lead)}
    return out


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag}={text!r} is invalid: expected comma-separated integers, e.g. 2,4") from None


def _fmt_ms(s: float) -> str:
    return f"{1000 * s:.0f}"


def _load_words(env: dict) -> str:
    """What the machine was doing before the ranks started: quiet (its cores under 25 % busy over the 3 s before)
    or shared; with the load averages before and at the end (the ranks' own load included) and their niceness.
    The busy share is the measure: a 1-minute load average still counts work that stopped a minute ago."""
    start, end, busy = env["loadavg_start"][0], env["loadavg_end"][0], env.get("cpu_busy_pct_before")
    quiet = busy is not None and busy < 25
    said = f"cores {busy:.0f} % busy before the runs, " if busy is not None else ""
    return (f"**{'a quiet' if quiet else 'a shared'} machine** ({said}load average {start:.1f} before the runs, "
            f"{end:.1f} at the end with the ranks' own; niceness {env['nice']})")


def markdown(bench: dict) -> str:
    env = bench["env"]
    lines = [f"# Our runtime vs torch.distributed.pipelining (profile {bench['profile']}, model "
             f"{bench['model']}, gloo, CPU)", "",
             f"Both engines train the same stage modules from the same initial weights on the same micro-batches, "
             f"{bench['steps']} steps each, alternating step by step in the same P processes (one torch thread "
             f"each); step time = the slowest rank's, barrier to end of the optimizer step, median over steps "
             f"{bench['warmup']}..{bench['steps'] - 1} (step 0, the library's set-up, excluded). Timings were "
             f"taken on {env['cpus']} cores, {_load_words(env)}; alternating means both engines saw the same load. "
             f"torch {env['torch']}.", "",
             "Losses: *bit-identical* means every step's loss is the same float64 on both engines; gradient "
             "norms are each stage's before clipping, compared per step and stage.", "",
             "Step time, ours / library: of the medians; *paired*: the median (and quartiles) of step k's ours / "
             "library, two steps run back to back; *fastest*: of each engine's fastest step (the least disturbed).",
             "",
             "| method | schedule | P | M | losses (all steps) | max abs loss diff | grad norms per stage | "
             "ours ms/step | library ms/step | ours / library | paired [quartiles] | fastest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in bench["cells"]:
        meth = c["method"] if c["method"] == "none" else f"{c['method']} {c['ratio']:g}x"
        gn = "bit-identical" if c["grad_norm_bit_identical"] else f"max rel diff {c['grad_norm_max_rel_diff']:.1e}"
        lines.append(f"| {meth} | {c['schedule']} | {c['stages']} | {c['micro_batches']} | "
                     f"{'bit-identical' if c['loss_bit_identical'] else 'differ'} | {c['loss_max_abs_diff']:.1e} | "
                     f"{gn} | {_fmt_ms(c['ours']['median_step_s'])} | {_fmt_ms(c['library']['median_step_s'])} | "
                     f"{c['step_time_ratio']:.2f} | {c['paired_ratio']['median']:.2f} [{c['paired_ratio']['q1']:.2f}, "
                     f"{c['paired_ratio']['q3']:.2f}] | {c['fastest_ratio']:.2f} |")
    lines += schedule_only_lines(bench)
    lines += ["", f"Losses of the first cell, step by step: ours {bench['cells'][0]['ours']['loss']}, library "
              f"{bench['cells'][0]['library']['loss']}.", ""]
    if bench.get("summary"):
        lines += [bench["summary"], ""]
    lines += ["What the library can carry (its rule: each stage output goes forward; each floating-point output "
              "gets back one gradient of its own shape and dtype; integer outputs get none):", ""]
    for m, msg in bench["messages"].items():
        what = f"forward {msg['fwd']}, gradient {msg['bwd']}"
        name = m if msg["ratio"] == 1 else f"{m} (d/r = {msg['ratio']:g})"
        lines.append(f"* {name}: " + (f"refused: {msg['refusal']}" if msg["refusal"] else
                     f"carried ({what}; the 16-bit token ids go as a second, integer output without gradient)"))
    return "\n".join(lines) + "\n"


def schedule_only_lines(bench: dict) -> list[str]:
    """The engines' own part of a step (barrier to the shared finish_step: the optimizer excluded), per cell and
    pooled per method, with whether this run could resolve a 5 % difference."""
    cells = [c for c in bench["cells"] if "schedule_only" in c]
    if not cells:
        return []
    lines = ["", "## Without the optimizer step", "",
             "The same steps timed from the barrier to the shared `finish_step` (loss all-reduce, clipping, optimizer: "
             "the same code in both engines, about two thirds of a CPU step, which hides the engines' difference). "
             "*ratio*: geometric mean of step k's ours / library over the timed steps, with its 95 % t interval; "
             "*detects*: the smallest difference these steps detect with 80 % power at that level.", "",
             "| method | schedule | P | M | ours ms | library ms | ours / library [95 % CI] | detects | 5 % resolvable |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        so = c["schedule_only"]
        meth = c["method"] if c["method"] == "none" else f"{c['method']} {c['ratio']:g}x"
        lines.append(f"| {meth} | {c['schedule']} | {c['stages']} | {c['micro_batches']} | "
                     f"{_fmt_ms(so['ours_median_s'])} | {_fmt_ms(so['library_median_s'])} | {so['ratio']:.3f} "
                     f"[{so['ci'][0]:.3f}, {so['ci'][1]:.3f}] | {100 * so['mde']:.1f} % | "
                     f"{'yes' if so['resolves_5pct'] else 'no'} |")
    for method, pooled in (bench.get("schedule_only_pooled") or {}).items():
        if pooled:
            lines += ["", f"Pooled over the {pooled['cells']} cells of {method} (interval across cells): ours / library "
                          f"{pooled['ratio']:.3f} [{pooled['ci'][0]:.3f}, {pooled['ci'][1]:.3f}]."]
    return lines


def summary_line(cells: list[dict]) -> str:
    """The verdict on the uncompressed pipeline: paired ratios within 10 % of parity, or which are not."""
    none = [c for c in cells if c["method"] == "none"]
    if not none:
        return ""
    paired = [c["paired_ratio"]["median"] for c in none]
    slow = [f"{c['schedule']} P={c['stages']} M={c['micro_batches']} ({c['paired_ratio']['median']:.2f})"
            for c in none if c["paired_ratio"]["median"] > 1.10]
    return (f"Uncompressed pipeline: paired ours / library {min(paired):.2f}-{max(paired):.2f} over {len(none)} "
            f"cells (median {statistics.median(paired):.2f}); "
            + (f"more than 10 % slower: {', '.join(slow)}." if slow else "none more than 10 % slower."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--methods", default="none,mapl", help=f"comma-separated, of {list(METHODS)}")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--micro", default="4,8")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--steps", type=int, default=24, help="steps per engine and cell (step 0 is not timed)")
    ap.add_argument("--json", default=str(ROOT / "reports/bench/peer-pipelining.json"))
    ap.add_argument("--md", default=str(ROOT / "reports/tables/peer-pipelining.md"))
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a.worker)
        return 0
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        print(f"error: --methods {bad} is invalid: allowed {list(METHODS)}", file=sys.stderr)
        return 2
    if a.steps < 2:
        print(f"error: --steps={a.steps} is invalid: must be >= 2 (step 0 is not timed)", file=sys.stderr)
        return 2
    schedules = a.schedules.split(",")
    try:
        stages, micro = _ints("--stages", a.stages), _ints("--micro", a.micro)
        groups = [cell_configs(a.profile, m, P, schedules, micro) for m in methods for P in stages]
        for cfg in (c for cfgs in groups for c in cfgs):
            cfg.validate()                   # what can be checked before the data: schedule x M x P, ...
        open_run_data(groups[0][0])          # the prepared data, checked once here (else every rank fails)
    except (ValueError, FileNotFoundError) as e:          # ConfigError, mapl.data's missing/corrupt data
        print(f"error: {e}", file=sys.stderr)
        return 2
    bench = {"profile": a.profile, "steps": a.steps, "warmup": 1, "methods": methods,
             "env": {"torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()),
                     "cpu_busy_pct_before": psutil.cpu_percent(interval=3.0), "nice": os.nice(0)}, "cells": []}
    t0 = time.time()
    bench["model"] = groups[0][0].model
    for cfgs in groups:
        for cfg, ranks in zip(cfgs, run_group(cfgs, a.steps)):
            cell = summarize(cfg, ranks, bench["warmup"])
            bench["cells"].append(cell)
            print(f"{cfg.compressor.method} {cfg.train.schedule} P={cfg.stages} M={cfg.train.micro_batches}: loss "
                  f"{'bit-identical' if cell['loss_bit_identical'] else 'DIFFERS'} "
                  f"(max {cell['loss_max_abs_diff']:.1e}), ours/library {cell['step_time_ratio']:.2f}, paired "
                  f"{cell['paired_ratio']['median']:.2f}", flush=True)
    bench["env"]["loadavg_end"] = list(os.getloadavg())
    bench["schedule_only_pooled"] = {m: pooled_ratio([c["schedule_only"] for c in bench["cells"] if c["method"] == m])
                                     for m in methods}
    bench["wall_s"] = time.time() - t0
    bench["messages"] = boundary_messages(a.profile)
    bench["summary"] = summary_line(bench["cells"])
    atomic_write_json(Path(a.json), bench)
    atomic_write_text(Path(a.md), markdown(bench))
    print(f"wrote {a.json} and {a.md} ({bench['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
