"""One rank of ``mapl pipeline``, from an initialised process group to its results: compile what the first step
would, open the data, make the groups and transport, print the memory plan, build the stage, resume, train."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..engine import RunData, open_run_data, resolve_data_dir
from ..link import LinkProfile
from ..loop import train
from .faults import FaultPlan
from .topology import Topology
from .transport import Transport
from .worker import PipelineEngine

__all__ = ["run_rank", "open_data", "print_memory_plan", "warm_compiled_kernels"]


def _gather_errors(err: str | None, group=None) -> None:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, err, group=group)
    bad = [f"rank {i}: {e}" for i, e in enumerate(out) if e]
    if bad:
        raise ValueError("; ".join(bad))


def open_data(cfg: RunConfig, topo: Topology, faults: FaultPlan | None = None) -> RunData:
    """Each host's first process opens (verifies) the data first, then the others; ranks wait for it without a
    timeout (saying so after 5 s), so a slow verification is never a dead peer. An error on any rank ends all."""
    local0 = int(os.environ.get("LOCAL_RANK", topo.rank)) == 0
    data, err = None, None
    for turn in (True, False):
        note = threading.Timer(5.0, lambda: print(f"rank {topo.rank}: waiting for the other ranks to open the data in "
                                                  f"{resolve_data_dir(cfg)} (no timeout)", flush=True))
        if local0 == turn:
            try:
                if topo.rank == 0 and faults is not None and faults.data_delay_s:
                    time.sleep(faults.data_delay_s)              # fault injection: a slow verification
                data = open_run_data(cfg)
            except (ValueError, FileNotFoundError) as e:         # mapl.data's DataError, MissingDataError
                err = str(e)
        else:
            note.start()
        try:
            _gather_errors(err)
        finally:
            note.cancel()
    return data


def print_memory_plan(cfg: RunConfig, vocab: int, topo: Topology, log) -> RunConfig:
    """Rank 0 prints the memory plan; on a GPU every rank refuses a stage that does not fit. Returns ``cfg`` with
    ``train.activation_checkpointing: auto`` decided by the plan."""
    from .. import memory
    cuda = topo.device.type == "cuda"
    device_bytes = torch.cuda.get_device_properties(topo.device).total_memory if cuda else None
    plan = memory.memory_plan(cfg, vocab, device=topo.device.type, device_bytes=device_bytes)
    if topo.rank == 0:
        log(memory.format_plan(plan))
    if cuda:
        memory.check_plan(plan, device_bytes)
    return replace(cfg, train=replace(cfg.train, activation_checkpointing="on" if plan.checkpointing else "off"))


def warm_compiled_kernels(cfg: RunConfig, topo: Topology, log) -> bool:
    """Compile MAPL+RVQ's fused search now (~30 s cold), where neighbours wait without a timeout, not in the first
    step under the communication timeout. Whether anything was compiled."""
    from ..compress import build_boundary
    from ..compress.rvq.search import uses_fused, warm_fused_search
    q = cfg.compressor.rvq
    if cfg.compressor.method != "mapl-rvq" or topo.last or not uses_fused(q.search_kernel, topo.device):
        return False
    d = cfg.model_config().d_model
    with torch.device("meta"):           # shapes only: nothing allocated, no generator consumed
        vq = build_boundary(cfg.compressor_for(d), d, topo.stage).rvq
    started = time.perf_counter()
    warm_fused_search(vq.groups, vq.codebook_size, vq.sub_dim, torch.float32, topo.device)
    log(f"rank {topo.rank}: compiled the RVQ search kernel in {time.perf_counter() - started:.1f} s")
    return True


def run_rank(cfg: RunConfig, topo: Topology, *, out: Path | None, ckpt: Path | None, fresh: bool = False,
             progress: bool = True, log=print, timeout_s: float = 60.0, link: LinkProfile | None = None,
             blocking: bool = False, resume_with_changes: bool = False, faults: FaultPlan | None = None,
             started: float | None = None) -> dict | None:
    """Train ``cfg`` as rank ``topo.rank``; rank 0 returns the results dict (and writes ``out``), others None."""
    if cfg.train.threads or topo.device.type == "cpu":
        torch.set_num_threads(cfg.train.threads or 1)
    quiet = log if topo.rank == 0 else (lambda *a, **k: None)
    warm_compiled_kernels(cfg, topo, quiet)
    data = open_data(cfg, topo, faults)
    world_group, dp_group = topo.make_groups(timeout_s)
    tx = Transport(topo.rank, topo.prev, topo.next, topo.device, timeout_s, link, blocking, world_group,
                   stages=topo.stages)
    err = None
    try:
        cfg = cfg.validate(data.vocab_size)
        cfg = print_memory_plan(cfg, data.vocab_size, topo, quiet)
    except ValueError as e:
        err = str(e)
    _gather_errors(err, world_group)
    info = {"backend": topo.backend, "launcher": topo.launcher, "timeout_s": timeout_s,
            "transport": "blocking" if blocking else "non-blocking"}
    engine = PipelineEngine(cfg, topo, data, tx, dp_group, ckpt, quiet, info, faults)
    if fresh and engine.ckpts is not None:
        engine.ckpts.slot.remove()
        engine.agree(None)                # every file is gone before any rank looks for one
    state = engine.resume(resume_with_changes)
    t = cfg.train
    quiet(f"{cfg.name()}: {topo.world} processes ({topo.stages} stages x {topo.replicas} replicas), backend "
          f"{topo.backend}, schedule {t.schedule}, {t.micro_batches} micro-batches, {info['transport']} transport"
          + (f", link delay {link.name}" if link else ""))
    return train(engine, state, out=out if topo.rank == 0 else None, log=quiet, progress=progress, started=started)
