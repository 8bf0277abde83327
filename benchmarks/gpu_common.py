"""Shared pieces of benchmarks/gpu.py: adapters to the project's APIs, the JSONL recorder, the time budget.

The adapters at the top are the only places that know today's module layout; when the runtime
(``mapl.core.loop``/``mapl.core.engine``), data (``mapl.data`` package with ``sampling="epochs"``) and planner
(``mapl.planning.costmodel``) rewrites land, only these functions change.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mapl import data as mdata
from mapl.core import engine as mengine
from mapl.core import link as mlink
from mapl.core.loop import lr_factor
from mapl.core.config import load_run_config
from mapl.core.stages import StagedModel, build_staged_model

__all__ = ["run_config", "build_model", "stage_of_parameter", "stage_optimizers", "autocast", "lr_scale", "set_lr",
           "open_corpus", "epoch_batch", "train_step", "link_estimate", "Recorder", "Budget", "sync", "timed",
           "free_device", "digest", "LINKS", "H200_PEAK_BF16"]

LINKS = ("80Mbps", "200Mbps", "1Gbps")           # mapl.core.link.PROFILES: 50 ms, 50 ms, 10 ms one-way latency
H200_PEAK_BF16 = 989e12                          # dense bf16 FLOP/s, vendor datasheet (H100/H200 SXM)


# ==== adapters (today's main APIs) ======================================================================
def run_config(profile: str, overrides: dict):
    """A validated RunConfig from a params.yaml profile plus dotted overrides (mapl.core.config)."""
    return load_run_config(profile, overrides)


def build_model(cfg, vocab: int, device: torch.device) -> StagedModel:
    """The single-process staged model (every stage in this process), in training mode on ``device``."""
    return build_staged_model(cfg, vocab).to(device).train()


stage_of_parameter = mengine.stage_of_parameter    # the stage that holds a StagedModel parameter


def stage_optimizers(sm: StagedModel, cfg) -> list[list[torch.optim.Optimizer]]:
    """One optimizer set per stage, as each pipeline process builds it (mapl.core.engine.build_optimizers)."""
    names = [(n, p) for n, p in sm.named_parameters() if p.requires_grad]
    out = []
    for s in range(sm.n_stages):
        foreign = {id(p) for n, p in names if stage_of_parameter(n, sm.split) != s}
        out.append(mengine.build_optimizers(sm, cfg, exclude=foreign))
    return out


def autocast(cfg, device: torch.device):
    return mengine.autocast_ctx(cfg, device)


def lr_scale(step: int, cfg) -> float:
    return lr_factor(step, cfg)


def set_lr(opts, factor: float) -> None:
    mengine.set_lr(opts, factor)


def open_corpus(data_dir: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, val, manifest) of a prepared folder; sha256-checked, never tokenizes or downloads."""
    manifest = mdata.read_manifest(data_dir)
    return mdata.load_split(data_dir, "train"), mdata.load_split(data_dir, "val"), manifest


def epoch_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int):
    """Step ``step``'s windows under the "epochs" policy of mapl.data (a seeded permutation of the
    non-overlapping windows; sample g = step * B + b reads window perm[g]): within one epoch no token
    is read twice. Later: ``mapl.data.get_batch(..., sampling="epochs")`` (same formula)."""
    n_windows = (len(tokens) - 1) // seq_len
    g = step * batch_size + np.arange(batch_size, dtype=np.int64)
    if g[-1] >= n_windows:
        raise ValueError(f"step {step} would read window {g[-1]} of {n_windows}: the run would repeat the corpus")
    order = np.random.default_rng([seed, 0, n_windows]).permutation(n_windows)
    starts = order[g] * seq_len
    w = mdata.take_windows(tokens, starts, seq_len + 1).astype(np.int64)
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def train_step(sm: StagedModel, opts: list, cfg, x: torch.Tensor, y: torch.Tensor, device) -> float:
    """One optimizer step on the batch (x, y): what mapl.core.run.run does per step (micro-batches through
    every wire, receiver-side projector gradients, global clipping, optimizers, projector sync).
    Later: ``LocalEngine.train_step`` once it can be handed its batch."""
    t = cfg.train
    mb = x.shape[0] // t.micro_batches
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(t.micro_batches):
        with autocast(cfg, device):
            loss = sm(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / t.micro_batches
        loss.backward()
        loss_sum += loss.detach()
    for comp in sm.compressors():
        comp.fold_receiver_grad()
    if t.grad_clip:
        torch.nn.utils.clip_grad_norm_([p for p in sm.parameters() if p.grad is not None], t.grad_clip)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for comp in sm.compressors():
            payload = comp.sync_payload()
            if payload:
                comp.apply_sync(payload)
    return float(loss_sum)


def link_estimate(timing: dict, schedule: str, micro_batches: int) -> dict:
    """Step time on each link of LINKS (and the compute-only makespan) from per-stage times and bytes,
    through the virtual clock of mapl.core.link (later: mapl.planning.costmodel)."""
    P = len(timing["fwd_s"])
    meas = mlink.StepMeasurement(schedule, [[timing["fwd_s"][s]] * micro_batches for s in range(P)],
                                 [[timing["bwd_s"][s]] * micro_batches for s in range(P)],
                                 timing["fwd_bytes"], timing["bwd_bytes"], timing["opt_s"],
                                 timing["state_fwd_bytes"], timing["state_bwd_bytes"], collective=True)
    return mlink.estimate(meas, LINKS)


# ==== device timing ====================================================================================
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed(device: torch.device, out: dict, key: str):
    """Adds the seconds of the block to ``out[key]``, synchronizing the device before and after."""
    sync(device)
    t0 = time.perf_counter()
    yield
    sync(device)
    out[key] = out.get(key, 0.0) + time.perf_counter() - t0


def free_device(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ==== results: JSON lines, written as measured ===========================================================
def _clean(obj):
    """JSON-safe: NaN/inf become None (strict JSON), tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class Recorder:
    """Appends one JSON object per line to ``path`` and flushes it to disk at once: a run cut off by
    the device's time limit still leaves every finished measurement behind."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self.counts: dict[str, int] = {}

    def write(self, kind: str, **fields) -> dict:
        rec = _clean({"kind": kind, "t": round(time.time(), 3), **fields})
        self._f.write(json.dumps(rec, sort_keys=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return rec

    def close(self) -> None:
        self._f.close()


class Budget:
    """Wall-clock budget of the whole script. ``allows(estimate)`` is asked before each item; an item
    that would end past ``total - reserve`` is skipped (and recorded as skipped by the caller)."""

    def __init__(self, total_s: float, start: float | None = None):
        self.total_s = float(total_s)
        self.start = time.monotonic() if start is None else start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def allows(self, estimate_s: float, reserve_s: float = 0.0) -> bool:
        return self.left() - reserve_s >= estimate_s


def digest(*tensors: torch.Tensor, seed: bytes = b"") -> str:
    """Running sha256 over token ids: equal digests = the same tokens in the same order."""
    h = hashlib.sha256(seed)
    for t in tensors:
        h.update(t.detach().cpu().numpy().astype(np.int64).tobytes())
    return h.hexdigest()[:16]
