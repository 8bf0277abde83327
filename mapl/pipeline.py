"""The multi-process pipeline: P stages as P processes (rank s = stage s), gloo on CPU, NCCL on GPU.

Every rank builds the same full ``StagedModel`` (deterministic in the seeds), then keeps only its
stage (``prune_to_stage``); stage s > 0 also keeps its copy of boundary s-1's compressor (the
receiver side). Per micro-batch the sender runs ``stage_forward`` to z, ``comp.pack(z)`` and sends
each payload tensor (plus token ids when an anchor needs them); the receiver allocates from
``comp.payload_spec``, receives, ``unpack``s and runs its stage. Backward mirrors it with
``pack_grad``/``unpack_grad``. This computes what the single-process loop (``mapl.train.run``, where
``WireTransfer`` stands at each boundary) computes, and tests hold the two to the same losses.

Launch (the rank count must equal ``--stages``)::

    torchrun --standalone --nproc_per_node 2 -m mapl.pipeline --profile micro --method mapl --ratio 4 --stages 2
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no --main_process_port 29555 \\
        -m mapl.pipeline --profile micro --method mapl --ratio 4 --stages 2

(``accelerate launch --cpu`` silently starts ONE process; ``--multi_gpu`` + ``ACCELERATE_USE_CPU`` is
the working CPU form, design/STACK.md §3.) From Python: ``launch(args, nprocs)``.

Why a hand-written schedule over ``dist.isend``/``dist.irecv`` and not
``torch.distributed.pipelining``: a ``PipelineStage`` sends the stage output tensor(s) forward and
exactly their gradients back. A compressed boundary is asymmetric -- e.g. integer RVQ codes (+ a
streamed codebook slice) forward and an r-wide float gradient backward -- and an integer output
carries no gradient, so the library can only train upstream if the float activation also crosses
the wire (STACK.md §2.3): it cannot put *only* the compressed bytes on the wire. Its shape
inference also runs stages on uninitialised buffers (ANCHORS.md pitfalls), which would corrupt
stateful compressors. Here each message is exactly ``pack``'s tensors, sent as raw bytes (so any
dtype crosses gloo and NCCL alike), and the meter counts precisely what is handed to
torch.distributed.

Step protocol (per rank, see ``_Runtime.train_step``): the schedule's forward/backward ops
(``mapl.link.schedule_ops``: GPipe or 1F1B) -> wait for own sends -> receiver-side projector
gradients sent back (fp32, added to the sender's A.grad) -> one all-reduce carrying the per-parameter
grad norms (so clipping uses the GLOBAL norm, bit-identical to ``clip_grad_norm_`` in one process)
and the step loss (which only the last stage knows; every rank logs and checks it) -> optimizer
step -> ``sync_payload`` to the receiver (``apply_sync``). The loss is mean cross-entropy of the
micro-batch / M, as in the single-process loop. Eval runs the same wire forward-only, in eval mode.

Faults: the process group has a timeout (``--timeout``, default 60 s); a rank that loses a peer
exits non-zero with a message naming the operation, the peer and the step. Each rank checkpoints
to ``<ckpt stem>.rank{s}.pt`` (atomic, ``weights_only`` loadable, previous one kept as
``.rank{s}.prev.pt``); a rerun resumes at the newest step all ranks have. Fault injection for
tests: ``MAPL_FAULT_KILL_RANK=1 MAPL_FAULT_KILL_STEP=3`` makes rank 1 ``os._exit(1)`` in the middle
of step 3 (0-based: after 3 completed steps).

Real-delay mode (``--link-delay 80Mbps``, optionally ``--link-latency-ms``): each message carries its
send time and the receiver sleeps until it would have arrived over that link (same FIFO model as
``mapl.link``'s virtual clock), so the wall clock can be checked against the model. Single host only
(it compares ``time.time()`` across processes).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint
from . import data as mdata
from . import train as mtrain
from .config import PROJECT_ROOT, RunConfig
from .engine import autocast_ctx, build_optimizers, check_projectors, open_run_data, resolve_data_dir, set_lr
from .loop import LoopState, NonFiniteError, StepOutcome, train
from .results import build_results, describe_boundary
from .link import PROFILES, LinkProfile, StepMeasurement, estimate, get_profile, schedule_ops, step_time
from .stages import StagedModel, build_staged_model
from .wire import ByteMeter

__all__ = ["run_pipeline", "init_distributed", "launch", "LaunchResult", "CommError", "rank_ckpt_path", "main"]

DEFAULT_TIMEOUT_S = 60.0
# message kinds (gloo matches p2p messages by source and tag; NCCL ignores tags and relies on order,
# which both sides keep identical)
TAG_FWD, TAG_BWD, TAG_RGRAD, TAG_SYNC, TAG_META, TAG_CHECK = 1, 2, 3, 4, 5, 6
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class CommError(RuntimeError):
    """A point-to-point or collective operation failed: a peer died, or the timeout expired."""


# ---- transport --------------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's exact bytes as a flat uint8 tensor (what goes on the wire)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.tensor([], dtype=dtype).element_size()


class _Wire:
    """isend/irecv of whole messages (lists of tensors) as raw bytes, with wait accounting, error
    context and the optional link-delay emulation."""

    def __init__(self, rank: int, device: torch.device, timeout_s: float, link: LinkProfile | None):
        self.rank, self.device, self.timeout_s, self.link = rank, device, timeout_s, link
        # one process group per direction: each side then issues the ops of a group in the same order
        # (s sends F0, F1, ... and s+1 receives them in that order; gradients likewise the other way).
        # NCCL serialises a communicator's p2p kernels on one stream, so mixing directions in one group
        # could deadlock 1F1B on large messages; gloo does not care, and runs the same code.
        tmo = timedelta(seconds=timeout_s)
        self.groups = {"fwd": dist.new_group(timeout=tmo), "bwd": dist.new_group(timeout=tmo)}
        self.pending: list = []
        self.wait_s = 0.0
        self.context = "setup"
        self._chan_free = defaultdict(float)     # src rank -> when its channel to us is free (delay mode)

    def _fail(self, what: str, e: Exception):
        raise CommError(f"{what} failed during {self.context}: a peer stage died or did not answer within the "
                        f"{self.timeout_s:g} s process-group timeout ({type(e).__name__}: {str(e).strip()[:300]})") from e

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, what: str) -> None:
        group = self.groups["fwd" if dst > self.rank else "bwd"]
        try:
            if self.link is not None:
                ts = torch.tensor([time.time()], dtype=torch.float64, device=self.device)
                self.pending.append((dist.isend(_raw(ts), dst, group=group, tag=tag), ts))
            for t in tensors:
                raw = _raw(t.to(self.device))
                self.pending.append((dist.isend(raw, dst, group=group, tag=tag), raw))
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure here
            self._fail(f"send of {what} to stage {dst}", e)

    def recv(self, specs: list[tuple[tuple[int, ...], torch.dtype]], src: int, tag: int, what: str) -> list[torch.Tensor]:
        bufs = [torch.empty(_nbytes(s, dt), dtype=torch.uint8, device=self.device) for s, dt in specs]
        ts = torch.empty(8, dtype=torch.uint8, device=self.device) if self.link is not None else None
        group = self.groups["fwd" if src < self.rank else "bwd"]
        t0 = time.perf_counter()
        try:
            works = ([dist.irecv(ts, src, group=group, tag=tag)] if ts is not None else []) + \
                [dist.irecv(b, src, group=group, tag=tag) for b in bufs]
            for w in works:
                w.wait()
            if self.device.type == "cuda":      # NCCL's wait only orders streams: finish the receive here
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as e:          # noqa: BLE001
            self._fail(f"receive of {what} from stage {src}", e)
        if ts is not None:
            sent = float(ts.view(torch.float64).item())
            nbytes = sum(b.numel() for b in bufs)
            start = max(sent, self._chan_free[src])
            self._chan_free[src] = start + self.link.transfer_s(nbytes)
            delay = self._chan_free[src] + self.link.latency_s - time.time()
            if delay > 0:
                time.sleep(delay)
        self.wait_s += time.perf_counter() - t0
        return [b.view(dt).reshape(s) for b, (s, dt) in zip(bufs, specs)]

    def flush(self) -> None:
        t0 = time.perf_counter()
        try:
            for w, _ in self.pending:
                w.wait()
        except Exception as e:          # noqa: BLE001
            self._fail("completing sends to the neighbour stages", e)
        finally:
            self.pending = []
            self.wait_s += time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor, what: str, hops_latency: float = 0.0) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
        except Exception as e:          # noqa: BLE001
            self._fail(f"all-reduce of {what} across all stages", e)
        if self.link is not None and hops_latency > 0:
            time.sleep(hops_latency)
        self.wait_s += time.perf_counter() - t0
        return t

    def gather_object(self, obj, what: str):
        out = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:          # noqa: BLE001
            self._fail(f"all-gather of {what} across all stages", e)
        return out


# ---- distributed setup ------------------------------------------------------------------------
def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S):
    """Process-group setup through accelerate (used as launcher/initialiser only, never to wrap the
    model): gloo on CPU, NCCL on GPU, with ``timeout_s`` on every collective and p2p wait.
    Returns (accelerator, rank, world, device, backend)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")
    # InitProcessGroupKwargs forwards only non-default values; 600 s is its NCCL default, so nudge it
    t = float(timeout_s) if float(timeout_s) != 600 else 600.001
    acc = Accelerator(cpu=not cuda, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=t))])
    if dist.is_available() and dist.is_initialized():
        rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    else:
        rank, world, backend = 0, 1, None
    device = acc.device if cuda else torch.device("cpu")
    return acc, rank, world, device, backend


def rank_ckpt_path(ckpt: Path, rank: int, prev: bool = False) -> Path:
    """``checkpoints/run.pt`` -> ``checkpoints/run.rank1.pt`` (``.rank1.prev.pt`` for the previous one)."""
    ckpt = Path(ckpt)
    stem = ckpt.with_suffix("") if ckpt.suffix == ".pt" else ckpt
    return stem.with_name(f"{stem.name}.rank{rank}{'.prev' if prev else ''}.pt")


# ---- the runtime ------------------------------------------------------------------------------
class _Runtime:
    def __init__(self, cfg: RunConfig, rank: int, world: int, device: torch.device, wire: _Wire, log,
                 timeout_s: float):
        self.cfg, self.rank, self.P, self.device, self.wire, self.log = cfg, rank, world, device, wire, log
        self.reporter = rank == 0
        self.timeout_s = timeout_s
        t = cfg.train
        self.M, self.mb, self.T = t.micro_batches, t.batch_size // t.micro_batches, t.seq_len
        self.first, self.last = rank == 0, rank == world - 1

    # -- helpers
    def agree(self, err: str | None) -> None:
        """Raise the same ValueError on every rank if any rank reports an error."""
        errs = self.wire.gather_object(err, "status")
        bad = [f"rank {i}: {e}" for i, e in enumerate(errs) if e]
        if bad:
            raise ValueError("; ".join(bad))

    def sync_cuda(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def setup(self, ckpt: Path | None, fresh: bool) -> None:
        cfg, rank = self.cfg, self.rank
        if cfg.train.threads or self.device.type == "cpu":
            torch.set_num_threads(cfg.train.threads or 1)
        self.data_dir = resolve_data_dir(cfg)
        # rank 0 tokenizes if needed; then the first process of every other host checks (hashes) or
        # builds its copy; everyone else maps the verified shards without hashing them again
        local0 = int(os.environ.get("LOCAL_RANK", rank)) == 0
        for turn in (0, 1):
            err = None
            if (turn == 0 and rank == 0) or (turn == 1 and rank != 0 and local0):
                try:
                    mdata.prepare(cfg.data, self.data_dir)
                except (ValueError, FileNotFoundError, OSError) as e:
                    err = f"data preparation in {self.data_dir} failed: {e}"
            self.agree(err)
        err = None
        try:
            self.data = open_run_data(cfg, prepare=False)
        except ValueError as e:
            err = str(e)
        self.agree(err)
        self.manifest, self.train_tok, self.val_batches = self.data.manifest, self.data.train, self.data.val_batches
        vocab = self.data.vocab_size
        self.cfg = cfg = cfg.validate(vocab)

        sm = build_staged_model(cfg, vocab)
        self.model_cfg = sm.model.cfg
        self.split = sm.split
        self.global_params = [(n, p.dtype) for n, p in sm.named_parameters()]
        self.sm: StagedModel = sm.prune_to_stage(rank).to(self.device)
        self.comp_in = sm.boundaries[str(rank - 1)] if rank > 0 else None
        self.comp_out = sm.boundaries[str(rank)] if rank < self.P - 1 else None
        recv_params = list(self.comp_in.parameters()) if self.comp_in is not None else []
        self.excluded = {id(p) for p in recv_params}        # the receiver's copy is optimised by the sender
        self.opts = build_optimizers(sm, cfg, exclude=self.excluded)
        gidx = {n: i for i, (n, _) in enumerate(self.global_params)}
        self.owned = [(gidx[n], p) for n, p in sm.named_parameters() if id(p) not in self.excluded]
        self.rg_in = self.comp_in is not None and self.comp_in.receiver_grad_bytes_per_step() > 0
        self.rg_out = self.comp_out is not None and self.comp_out.receiver_grad_bytes_per_step() > 0
        self.meter = ByteMeter()
        self.saved_step: int | None = None
        self.sync_ok: list = []
        self.timing = {"fwd": [], "bwd": [], "opt": [], "wait": [], "wall": []}
        self._in_dtype = None
        self._dtype_sent = False
        self.ckpt = Path(ckpt) if ckpt else None
        self.checkpointing = self.ckpt is not None
        if self.ckpt is not None and fresh:
            for prev in (False, True):
                rank_ckpt_path(self.ckpt, rank, prev).unlink(missing_ok=True)

    # -- checkpoints
    def _peek(self, path: Path, allow_changes: bool) -> dict | None:
        if not path.exists():
            return None
        try:
            ck = checkpoint.read(path)
        except checkpoint.CheckpointError as e:      # a torn/foreign file: the other one may be fine
            print(f"rank {self.rank}: ignoring checkpoint {path}: {e}", file=sys.stderr)
            return None
        checkpoint.resume_changes(ck, path, self.cfg, allow_changes)      # refuses another config here
        return ck

    def resume(self, allow_changes: bool = False) -> LoopState | None:
        """The newest step every rank has a checkpoint of (current or previous file), or None."""
        if self.ckpt is None:
            return None
        self.wire.context = "checkpoint resume"
        err, have = None, {}
        try:
            for prev in (False, True):
                path = rank_ckpt_path(self.ckpt, self.rank, prev)
                ck = self._peek(path, allow_changes)
                if ck is not None and checkpoint.checkpoint_step(ck) not in have:
                    have[checkpoint.checkpoint_step(ck)] = (path, ck)
        except ValueError as e:
            err = str(e)
        self.agree(err)
        all_have = self.wire.gather_object(sorted(have), "checkpoint steps")
        common = set(all_have[0]).intersection(*map(set, all_have[1:]))
        if not common:
            if any(all_have):
                self.agree(f"per-rank checkpoints {self.ckpt} have no step in common (steps per rank: "
                           f"{all_have}); delete them or rerun with --fresh")
            return None
        path, ck = have[max(common)]
        state = checkpoint.restore(ck, path, self.cfg, self.sm, self.opts, self.meter, allow_changes)
        self.saved_step = state.step
        if self.rank == 0:
            self.log(f"resumed {self.P} per-rank checkpoints {rank_ckpt_path(self.ckpt, 0).name.replace('rank0', 'rank*')} "
                     f"at step {state.step}")
        return state

    def save(self, state: LoopState) -> None:
        """Every rank checks its values finite first; all write, or none does (the same step on disk)."""
        self.wire.context = f"checkpoint after step {state.step}"
        bad = checkpoint.first_nonfinite(self.sm, self.opts)
        errs = self.wire.gather_object(bad, "checkpoint check")
        culprits = [f"{name} (stage {r})" for r, name in enumerate(errs) if name]
        if culprits:
            kept = (f"the per-rank checkpoints keep step {self.saved_step}" if self.saved_step is not None
                    else "no checkpoint was written")
            raise NonFiniteError(f"non-finite values in {', '.join(culprits)} after step {state.step}: {kept}; lower "
                                 "the learning rate and resume with --resume-with-changes")
        path, prev = rank_ckpt_path(self.ckpt, self.rank), rank_ckpt_path(self.ckpt, self.rank, prev=True)
        if path.exists():
            os.replace(path, prev)
        checkpoint.save(path, cfg=self.cfg, model=self.sm, optimizers=self.opts, meter=self.meter, state=state)
        self.saved_step = state.step

    # -- messages
    def _send_fwd(self, out: torch.Tensor, ids: torch.Tensor | None, meter: ByteMeter | None) -> None:
        comp = self.comp_out
        if not self._dtype_sent:         # once per run: which float dtype the receiver unpacks to
            self.wire.send([torch.tensor([_DTYPES.index(out.dtype)], dtype=torch.int64)], self.rank + 1, TAG_META,
                           "dtype handshake")
            self._dtype_sent = True
        payload = comp.pack(out)
        msg = list(payload)
        if meter is not None:
            meter.add_payload(self.rank, "fwd", payload, comp.payload_roles("fwd"), tokens=out.shape[0] * out.shape[1])
        if self.sm.ids_on_wire:
            wire_ids = ids.to(self.sm.id_dtype)          # vocab <= 65536: the uint16 bit pattern in int16
            msg.append(wire_ids)
            if meter is not None:
                meter.add(self.rank, "fwd", "ids", wire_ids.numel() * wire_ids.element_size())
        self.wire.send(msg, self.rank + 1, TAG_FWD, "forward activations")

    def _recv_fwd(self, lead: tuple[int, int]):
        comp = self.comp_in
        if self._in_dtype is None:
            (code,) = self.wire.recv([((1,), torch.int64)], self.rank - 1, TAG_META, "dtype handshake")
            self._in_dtype = _DTYPES[int(code.item())]
        specs = comp.payload_spec(lead, "fwd")
        n = len(specs)
        if self.sm.ids_on_wire:
            specs = specs + [(lead, self.sm.id_dtype)]
        got = self.wire.recv(specs, self.rank - 1, TAG_FWD, "forward activations")
        ids = None
        if self.sm.ids_on_wire:
            ids = got[n].to(torch.int64)
            if self.sm.id_dtype == torch.int16:
                ids = ids & 0xFFFF
        return got[:n], ids

    # -- one training step
    def train_step(self, step: int, lr_scale: float, stop_requested=lambda: False) -> StepOutcome:
        cfg, t, sm, rank = self.cfg, self.cfg.train, self.sm, self.rank
        ts = time.time()
        wait0 = self.wire.wait_s
        set_lr(self.opts, lr_scale)
        x = y = None
        if self.first or self.last:
            x, y = mdata.get_batch(self.train_tok, t.batch_size, t.seq_len, t.seed, step)
            x, y = x.to(self.device), y.to(self.device)
        if os.environ.get("MAPL_FAULT_SIGTERM_RANK") == str(rank) and os.environ.get("MAPL_FAULT_SIGTERM_STEP") == str(step):
            os.kill(os.getpid(), signal.SIGTERM)          # fault injection (tests): a real signal mid-step
        kill_rank, kill_step = os.environ.get("MAPL_FAULT_KILL_RANK"), os.environ.get("MAPL_FAULT_KILL_STEP")
        die = kill_rank is not None and int(kill_rank) == rank and int(kill_step or 0) == step
        lead = (self.mb, self.T)
        saved = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # non-finite values seen by this stage (received message, own output), kept on the device: read
        # once per step with the all-reduce, so a NaN is located without a host sync per micro-batch
        bad_in = torch.zeros((), dtype=torch.bool, device=self.device)
        bad_out = torch.zeros((), dtype=torch.bool, device=self.device)
        fwd_t, bwd_t = [0.0] * self.M, [0.0] * self.M
        for kind, m in schedule_ops(t.schedule, self.P, self.M, rank):
            self.wire.context = f"step {step} ({kind}{m})"
            if kind == "F":
                ids = x[m * self.mb:(m + 1) * self.mb] if self.first else None
                z_in = None
                if not self.first:
                    payload, ids = self._recv_fwd(lead)
                t0 = time.perf_counter()
                if not self.first:
                    z_in = self.comp_in.unpack(payload, self._in_dtype).requires_grad_()
                    bad_in |= ~torch.isfinite(z_in).all()
                with autocast_ctx(cfg, self.device):
                    out = sm.stage_forward(rank, z_in, ids)
                    if self.last:
                        ys = y[m * self.mb:(m + 1) * self.mb]
                        out = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), ys.reshape(-1)) / self.M
                bad_out |= ~torch.isfinite(out.detach()).all()
                if self.last:
                    loss_sum += out.detach()
                else:
                    self._send_fwd(out, ids, self.meter)
                self.sync_cuda()
                fwd_t[m] += time.perf_counter() - t0
                saved[m] = (z_in, out)
                if die:
                    _inject_fault(rank, step)
            else:
                z_in, out = saved.pop(m)
                if not self.last:
                    gp = self.wire.recv(self.comp_out.payload_spec(lead, "bwd"), rank + 1, TAG_BWD, "gradients")
                t0 = time.perf_counter()
                if self.last:
                    out.backward()
                else:
                    out.backward(self.comp_out.unpack_grad(gp, out.dtype))
                if not self.first:
                    g = z_in.grad if z_in.grad is not None else torch.zeros_like(z_in)
                    payload = self.comp_in.pack_grad(g)
                    self.meter.add_payload(rank - 1, "bwd", payload, self.comp_in.payload_roles("bwd"),
                                           tokens=g.shape[0] * g.shape[1])
                    self.wire.send(payload, rank - 1, TAG_BWD, "gradients")
                self.sync_cuda()
                bwd_t[m] += time.perf_counter() - t0
        self.wire.context = f"step {step} (end)"
        self.wire.flush()
        t0 = time.perf_counter()
        # receiver-side gradient of the projector: back to its owner, which adds it to its own A.grad
        if self.rg_in:
            self.comp_in.fold_receiver_grad()
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float().clone()
                     for p in self.comp_in.parameters()]
            self.meter.add(rank - 1, "bwd", "state", sum(g.numel() * g.element_size() for g in grads))
            self.wire.send(grads, rank - 1, TAG_RGRAD, "receiver-side projector gradient")
        for p in self.comp_in.parameters() if self.comp_in is not None else []:
            p.grad = None
        opt_t = time.perf_counter() - t0
        if self.rg_out:
            params = list(self.comp_out.parameters())
            got = self.wire.recv([(tuple(p.shape), torch.float32) for p in params], rank + 1, TAG_RGRAD,
                                 "receiver-side projector gradient")
            for p, g in zip(params, got):
                g = g.to(p.dtype)
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        t0 = time.perf_counter()
        # one all-reduce: per-parameter grad norms (in the single-process parameter order) and the loss
        N = len(self.global_params) if t.grad_clip else 0
        # [norms (N), has-grad flags (N), non-finite codes (P), stop request, loss]: a SIGINT/SIGTERM on any
        # rank rides on the step's all-reduce, so every rank stops after the same step (no rank waits on a
        # stopped peer); non-finite code of stage s: 1 = its received message, 2 = its output
        P = self.P
        vec = torch.zeros(2 * N + P + 2, dtype=torch.float64, device=self.device)
        vec[-2] = 1.0 if stop_requested() else 0.0
        vec[2 * N + rank] = bad_in.to(torch.float64) + 2 * bad_out.to(torch.float64)
        if N:
            have = [(i, p) for i, p in self.owned if p.grad is not None]
            if have:
                norms = torch._foreach_norm([p.grad for _, p in have], 2.0)
                idx = torch.tensor([i for i, _ in have], device=self.device)
                vec[idx] = torch.stack([n.to(torch.float64) for n in norms])
                vec[N + idx] = 1.0
        if self.last:
            vec[-1] = loss_sum
        opt_t += time.perf_counter() - t0
        lat = 2 * self.wire.link.latency_s * (self.P - 1) if self.wire.link is not None else 0.0
        self.wire.all_reduce(vec, "grad norms and loss", lat)
        t0 = time.perf_counter()
        loss_sum = float(vec[-1])
        stop = bool(vec[-2] > 0)
        if not math.isfinite(loss_sum):
            return StepOutcome(loss_sum, stop, _nonfinite_place(vec[2 * N:2 * N + P].tolist()))
        if N:
            self._clip(vec, N, t.grad_clip)
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.comp_out is not None:       # the projector this stage owns
            check_projectors({rank: self.comp_out}, step)
        self.sync_cuda()
        opt_t += time.perf_counter() - t0
        self._sync_state()
        self.wire.flush()
        self.timing["fwd"].append(fwd_t)
        self.timing["bwd"].append(bwd_t)
        self.timing["opt"].append(opt_t)
        self.timing["wait"].append(self.wire.wait_s - wait0)
        self.timing["wall"].append(time.time() - ts)
        return StepOutcome(loss_sum, stop)

    def _clip(self, vec: torch.Tensor, N: int, max_norm: float) -> None:
        """Global-norm clipping, reproducing ``clip_grad_norm_`` over the whole model: the same
        per-parameter norms, stacked in the same order (grouped by dtype as torch groups them)."""
        mask = (vec[N:2 * N] > 0).tolist()
        groups: dict = {}
        for i, (_, dt) in enumerate(self.global_params):
            if mask[i]:
                groups.setdefault(dt, []).append(vec[i].to(dt))
        norms = [n for g in groups.values() for n in g]
        if not norms:
            return
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch.nn.utils.clip_grads_with_norm_([p for _, p in self.owned], max_norm, total)

    @torch.no_grad()
    def _sync_state(self) -> None:
        """After the optimizer step: learned state (projector A) from the sender to the receiver's copy."""
        self.wire.context = "state sync"
        if self.comp_out is not None:
            payload = self.comp_out.sync_payload()
            if payload:
                keys = sorted(payload)
                tensors = [payload[k].detach().clone() for k in keys]
                self.meter.add(self.rank, "fwd", "state", sum(v.numel() * v.element_size() for v in tensors))
                self.wire.send(tensors, self.rank + 1, TAG_SYNC, "state sync")
        if self.comp_in is not None:
            mine = self.comp_in.sync_payload()        # the receiver's own copy gives shapes and dtypes
            if mine:
                keys = sorted(mine)
                got = self.wire.recv([(tuple(mine[k].shape), mine[k].dtype) for k in keys], self.rank - 1, TAG_SYNC,
                                     "state sync")
                if os.environ.get("MAPL_FAULT_CORRUPT_SYNC") == str(self.rank):     # fault injection (tests)
                    got = [g + 1e-3 for g in got]
                self.comp_in.apply_sync({k: v.clone() for k, v in zip(keys, got)})

    def check_sync(self, step: int) -> list[bool]:
        """Compare each boundary's shared-state checksum between sender and receiver."""
        self.wire.context = f"checksum after step {step}"
        if self.comp_out is not None:
            self.wire.send([torch.tensor([self.comp_out.checksum()], dtype=torch.int64)], self.rank + 1, TAG_CHECK,
                           "state checksum")
        ok = None
        if self.comp_in is not None:
            (c,) = self.wire.recv([((1,), torch.int64)], self.rank - 1, TAG_CHECK, "state checksum")
            ok = int(c.item()) == self.comp_in.checksum()
        self.wire.flush()
        return [o for o in self.wire.gather_object(ok, "checksums")[1:]]

    # -- evaluation: the same wire, forward only, eval mode (no compressor state updates)
    def evaluate(self, step: int) -> float:
        """The validation loss (global), then the sender/receiver state checksums (warning on mismatch)."""
        val = self._validation_loss(step)
        self.sync_ok = self.check_sync(step)
        if not all(self.sync_ok):
            self.log(f"warning: shared state differs between sender and receiver at boundaries "
                     f"{[p for p, ok in enumerate(self.sync_ok) if not ok]} (checksum)", file=sys.stderr)
        return val

    @torch.no_grad()
    def _validation_loss(self, step: int) -> float:
        sm, rank = self.sm, self.rank
        was = sm.training
        sm.eval()
        total = 0.0
        for i, (x, y) in enumerate(self.val_batches):
            self.wire.context = f"evaluation after step {step} (batch {i})"
            lead = tuple(x.shape)
            ids, z_in = (x.to(self.device) if self.first else None), None
            if not self.first:
                payload, ids = self._recv_fwd(lead)
                z_in = self.comp_in.unpack(payload, self._in_dtype)
            with autocast_ctx(self.cfg, self.device):
                out = sm.stage_forward(rank, z_in, ids)
            if self.last:
                total += float(F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.to(self.device).reshape(-1)))
            else:
                self._send_fwd(out, ids, None)
        self.wire.flush()
        sm.train(was)
        vec = torch.tensor([total / max(1, len(self.val_batches)) if self.last else 0.0], dtype=torch.float64,
                           device=self.device)
        return float(self.wire.all_reduce(vec, "validation loss")[0])

    # -- results (gathered to rank 0)
    def measurement(self, merged: ByteMeter, timings: list[dict], steps: int) -> StepMeasurement:
        steps, M, P = max(1, steps), self.M, self.P

        def mean_rows(rows):     # mean over measured steps, dropping the first (warm-up) when we can
            rows = rows[1:] if len(rows) > 1 else rows
            return [sum(r[m] for r in rows) / max(1, len(rows)) for m in range(M)] if rows else [0.0] * M

        def mean(xs):
            xs = xs[1:] if len(xs) > 1 else xs
            return sum(xs) / max(1, len(xs))

        fb = [(merged.total("data", "fwd", p) + merged.total("sync", "fwd", p) + merged.total("ids", "fwd", p)) / (steps * M)
              for p in range(P - 1)]
        bb = [(merged.total("data", "bwd", p) + merged.total("sync", "bwd", p) + merged.total("ids", "bwd", p)) / (steps * M)
              for p in range(P - 1)]
        return StepMeasurement(self.cfg.train.schedule, [mean_rows(tm["fwd"]) for tm in timings],
                               [mean_rows(tm["bwd"]) for tm in timings], fb, bb,
                               [mean(tm["opt"]) for tm in timings],
                               [merged.total("state", "fwd", p) / steps for p in range(P - 1)],
                               [merged.total("state", "bwd", p) / steps for p in range(P - 1)], collective=True)

    def results(self, state: LoopState, wall_s: float) -> dict | None:
        """Every rank contributes plain data (its meter, timings, the boundary it sends on); rank 0
        builds the results dict."""
        if not self.sync_ok:
            self.sync_ok = self.check_sync(state.step)
        mine = {"meter": self.meter.state_dict(), "timing": self.timing,
                "boundary": (describe_boundary(self.comp_out, self.rank, self.cfg, self.sm.id_bytes_per_token())
                             if self.comp_out is not None else None),
                "n_params": sum(p.numel() for _, p in self.owned), "pid": os.getpid(), "host": socket.gethostname()}
        everyone = self.wire.gather_object(mine, "results")
        if self.rank != 0:
            return None
        merged = ByteMeter()
        for r in everyone:
            for b, d, k, v in r["meter"]["bytes"]:
                merged.add(b, d, k, v)
            for b, d, v in r["meter"]["tokens"]:
                merged.tokens[(b, d)] += v
        boundaries = [r["boundary"] for r in everyone[:-1]]
        res = build_results(self.cfg, state, boundaries, merged, d_model=self.model_cfg.d_model,
                            id_bytes_per_token=self.sm.id_bytes_per_token(),
                            n_params=sum(r["n_params"] for r in everyone), manifest=self.manifest, wall_s=wall_s)
        res["runtime"] = "multiprocess"
        res["schedule"] = self.cfg.train.schedule
        res["pipeline"] = self._pipeline_section(everyone, merged, boundaries, state.step)
        return res

    def _pipeline_section(self, everyone: list[dict], merged: ByteMeter, boundaries: list[dict], steps: int) -> dict:
        steps = max(1, steps)
        per_boundary = {b: {d: {k: v / steps for k, v in kinds.items()} for d, kinds in dirs.items()}
                        for b, dirs in merged.summary().items()}
        timings = [r["timing"] for r in everyone]
        meas = self.measurement(merged, timings, steps)
        n_meas = [max(0, len(tm["wall"]) - 1) if len(tm["wall"]) > 1 else len(tm["wall"]) for tm in timings]

        def mean(xs):
            xs = xs[1:] if len(xs) > 1 else xs
            return sum(xs) / len(xs) if xs else None

        info = self.info
        pipe = {
            "schedule": self.cfg.train.schedule, "processes": self.P, "backend": info["backend"],
            "launcher": info["launcher"], "pids": [r["pid"] for r in everyone], "hosts": [r["host"] for r in everyone],
            "timeout_s": self.timeout_s, "micro_batches": self.M,
            "stage_compute_s_per_step": [sum(meas.fwd_s[s]) + sum(meas.bwd_s[s]) for s in range(self.P)],
            "stage_opt_s_per_step": meas.opt_s,
            "stage_wait_s_per_step": [mean(tm["wait"]) for tm in timings],
            "step_wall_s": mean(timings[0]["wall"]), "timed_steps": n_meas[0],
            "bytes_per_step": per_boundary,
            "declared_bytes_per_step": {f"boundary{b['boundary']}": b["declared_per_step"] for b in boundaries},
            "timing": meas.to_dict(),
            "link_estimates": estimate(meas, PROFILES),
            "state_checksum_match": self.sync_ok,
        }
        if self.wire.link is not None:
            lk = self.wire.link
            pipe["link_delay"] = {"profile": lk.name, "bandwidth_bps": lk.bandwidth_bps, "latency_s": lk.latency_s,
                                  "measured_step_s": pipe["step_wall_s"], "model_step_s": step_time(meas, lk)}
        return pipe


def _nonfinite_place(codes: list[float]) -> str:
    """The first place holding a non-finite value, from the per-stage codes (1: received message, 2: output)."""
    last = len(codes) - 1
    for s, code in enumerate(codes):
        code = int(code)
        if code & 1:
            return f"boundary {s - 1} message after the wire (received by stage {s})"
        if code & 2:
            return f"stage {s} output (boundary {s}, before the wire)" if s < last else f"stage {s} loss"
    return "the loss only (activations finite)"


def _inject_fault(rank: int, step: int) -> None:
    """Tests: ``MAPL_FAULT_KILL_RANK``/``MAPL_FAULT_KILL_STEP`` select the victim; ``MAPL_FAULT_MODE=hang``
    makes it stop answering (sleeps, then exits) instead of dying at once."""
    mode = os.environ.get("MAPL_FAULT_MODE", "exit")
    print(f"MAPL_FAULT: rank {rank} {'hangs' if mode == 'hang' else 'exits with os._exit(1)'} in step {step} "
          f"(fault injection: MAPL_FAULT_KILL_RANK={rank} MAPL_FAULT_KILL_STEP={step})", file=sys.stderr, flush=True)
    if mode == "hang":
        time.sleep(float(os.environ.get("MAPL_FAULT_HANG_S", "300")))
    os._exit(1)


def run_pipeline(cfg: RunConfig, rank: int, world: int, device: torch.device, *, out: Path | None = None,
                 ckpt: Path | None = None, fresh: bool = False, progress: bool = True, log=print,
                 timeout_s: float = DEFAULT_TIMEOUT_S, link_delay: LinkProfile | None = None,
                 info: dict | None = None, resume_with_changes: bool = False) -> dict | None:
    """Train ``cfg`` as stage ``rank`` of ``world`` (process group already initialised). Rank 0 returns
    the results dict (and writes ``out``); the other ranks return None."""
    started = time.time()
    cfg.validate()                       # everything that does not need the tokenizer, before data is touched
    if world != cfg.stages:
        raise ValueError(f"stages={cfg.stages} but {world} process(es) were started: mapl.pipeline runs one "
                         f"process per stage")
    wire = _Wire(rank, device, timeout_s, link_delay)
    rt = _Runtime(cfg, rank, world, device, wire, log if rank == 0 else (lambda *a, **k: None), timeout_s)
    rt.info = info or {"backend": dist.get_backend(), "launcher": None}
    rt.setup(ckpt, fresh)
    state = rt.resume(resume_with_changes)
    t = rt.cfg.train
    if rank == 0:
        log(f"{rt.cfg.name()}: {world} processes, backend {rt.info.get('backend')}, schedule {t.schedule}, "
            f"{t.micro_batches} micro-batches" + (f", link delay {link_delay.name}" if link_delay else ""))
    return train(rt, state, out=out if rank == 0 else None, log=rt.log, progress=progress, started=started)


# ---- CLI --------------------------------------------------------------------------------------
def _extra_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mapl.pipeline", add_help=False,
                                 description="Multi-process pipeline options (all mapl.train flags apply too):")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], help="pipeline schedule (= --set train.schedule=...)")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("MAPL_PG_TIMEOUT", DEFAULT_TIMEOUT_S)),
                    help="process-group timeout in seconds: a dead stage makes the others fail after at most "
                         "this long (default %(default)s, env MAPL_PG_TIMEOUT)")
    ap.add_argument("--link-delay", metavar="PROFILE",
                    help=f"real-delay mode: delay every message as over this link ({', '.join(PROFILES)}, or "
                         "e.g. 500Mbps@20ms)")
    ap.add_argument("--link-latency-ms", type=float, help="override the link profile's one-way latency")
    return ap


def _parse(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _extra_parser()
    if "-h" in argv or "--help" in argv:
        ap.print_help()
        print("\nEvery mapl.train flag (below) applies; outputs default to reports/results/<run>-mp.json and "
              "checkpoints/<run>-mp.rank<s>.pt.\n")
        mtrain.parse_args(["--help"])
    extra, rest = ap.parse_known_args(argv)
    args = mtrain.parse_args(rest)
    if extra.schedule:
        args.set = list(args.set) + [f"train.schedule={extra.schedule}"]
    return extra, args


def main(argv=None) -> int:
    extra, args = _parse(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = mtrain.config_from_args(args)
        link = get_profile(extra.link_delay, extra.link_latency_ms) if extra.link_delay else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        acc, rank, world, device, backend = init_distributed(extra.timeout)
    except Exception as e:              # noqa: BLE001
        print(f"error: rank {rank}: process-group setup failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    if world != cfg.stages:
        if rank == 0:
            print(f"error: stages={cfg.stages} but {world} process(es) were started; mapl.pipeline runs one process "
                  f"per stage. Launch with `torchrun --standalone --nproc_per_node {cfg.stages} -m mapl.pipeline ...` "
                  f"or `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {cfg.stages} "
                  f"--num_machines 1 --mixed_precision no --dynamo_backend no -m mapl.pipeline ...` "
                  f"(`accelerate launch --cpu` silently starts ONE process)", file=sys.stderr)
        _exit(2)
    if world < 2:
        print("error: mapl.pipeline needs stages >= 2; for one stage use python -m mapl.train", file=sys.stderr)
        _exit(2)
    launcher = ("accelerate" if "ACCELERATE_MIXED_PRECISION" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ
                else "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "env")
    out = args.out or PROJECT_ROOT / "reports" / "results" / f"{cfg.name()}-mp.json"
    ckpt = args.ckpt or PROJECT_ROOT / "checkpoints" / f"{cfg.name()}-mp.pt"
    info = {"backend": backend, "launcher": launcher, "distributed_type": str(acc.distributed_type)}
    try:
        res = run_pipeline(cfg, rank, world, device, out=out, ckpt=ckpt, fresh=args.fresh,
                           progress=not args.no_progress, timeout_s=extra.timeout, link_delay=link, info=info,
                           resume_with_changes=args.resume_with_changes)
    except CommError as e:
        print(f"error: rank {rank} (stage {rank}): {e}", file=sys.stderr)
        _exit(3)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        _exit(2)
    except KeyboardInterrupt as e:      # a graceful stop: every rank agreed, checkpoints are written
        print(f"rank {rank}: {e}", file=sys.stderr)
        _exit(130)
    except BaseException as e:          # noqa: BLE001 -- never hang in teardown after a failure
        traceback.print_exc()
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        _exit(130 if isinstance(e, KeyboardInterrupt) else 1)
    if res is not None:
        print(json.dumps({k: res[k] for k in ("run", "val_loss", "tokens", "tokens_per_s", "ratio", "runtime", "schedule")}))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:                   # noqa: BLE001 -- results are written; teardown is best effort
        pass
    return 0


def _exit(code: int):
    """Leave at once: after a failure, process-group teardown can block on a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- launching from Python (tests, notebooks, benchmarks) ---------------------------------------
@dataclass
class LaunchResult:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    rank_returncodes: list = field(default_factory=list)     # launcher="direct" only
    rank_exit_s: list = field(default_factory=list)          # seconds from start to each rank's exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(env: dict | None) -> dict:
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("HF_DATASETS_OFFLINE", "1")
    e.setdefault("PYTHONUNBUFFERED", "1")
    if not torch.cuda.is_available():
        e["ACCELERATE_USE_CPU"] = "true"
    e.update(env or {})
    return e


def launch(cfg_args: list[str], nprocs: int, port: int | None = None, *, launcher: str = "accelerate",
           env: dict | None = None, timeout: float | None = None, cwd: Path | None = None) -> LaunchResult:
    """Run ``python -m mapl.pipeline <cfg_args>`` as ``nprocs`` processes and wait for them.

    launcher: "accelerate" (``accelerate launch --multi_gpu``; CPU via ACCELERATE_USE_CPU=true),
    "torchrun" (``torchrun --standalone``) or "direct" (this function starts the P processes itself
    with RANK/WORLD_SIZE/MASTER_* set, and reports each one's exit code and time)."""
    port = port or free_port()
    env = _child_env(env)
    cwd = cwd or PROJECT_ROOT
    mod = ["-m", "mapl.pipeline", *map(str, cfg_args)]
    t0 = time.time()
    if launcher in ("accelerate", "torchrun"):
        if launcher == "accelerate":
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nprocs),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(port), *mod]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs), *mod]
        try:
            p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            return LaunchResult(cmd, p.returncode, p.stdout, p.stderr, time.time() - t0)
        except subprocess.TimeoutExpired as e:
            return LaunchResult(cmd, -9, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                                (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""),
                                time.time() - t0)
    if launcher != "direct":
        raise ValueError(f"launcher={launcher!r} is invalid: allowed 'accelerate', 'torchrun', 'direct'")
    cmd = [sys.executable, *mod]
    procs, files = [], []
    for r in range(nprocs):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        fo, fe = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        files.append((fo, fe))
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=e, stdout=fo, stderr=fe, text=True))
    exit_s = [None] * nprocs
    while any(x is None for x in exit_s):
        for r, p in enumerate(procs):
            if exit_s[r] is None and p.poll() is not None:
                exit_s[r] = time.time() - t0
        if timeout is not None and time.time() - t0 > timeout:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    exit_s[r] = time.time() - t0
            break
        time.sleep(0.05)
    outs, errs = [], []
    for r, (fo, fe) in enumerate(files):
        fo.seek(0)
        fe.seek(0)
        outs.append("".join(f"[rank {r}] {line}" for line in fo.read().splitlines(True)))
        errs.append("".join(f"[rank {r}] {line}" for line in fe.read().splitlines(True)))
        fo.close()
        fe.close()
    rcs = [p.returncode for p in procs]
    rc = 0 if all(c == 0 for c in rcs) else next(c for c in rcs if c != 0)
    return LaunchResult(cmd, rc, "".join(outs), "".join(errs), time.time() - t0, rcs, exit_s)


if __name__ == "__main__":
    sys.exit(main())
