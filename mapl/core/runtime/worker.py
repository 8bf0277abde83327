"""``PipelineEngine``: one pipeline stage in this process, driven by the one training loop (mapl.core.loop).

Every rank builds the same full ``StagedModel`` (deterministic in the seeds), then keeps only its
stage (``prune_to_stage``); stage s > 0 also keeps its copy of boundary s-1's compressor (the
receiver side). A step executes the stage's program (``mapl.core.schedule.step_program``: the
body, then the tail; the checker proves exactly these actions deadlock-free):

``F(m)`` unpacks the received message, runs ``stage_forward`` and packs the output for stage s+1 (the last stage:
the loss / (M x R)); ``B(m)`` backpropagates the received gradient and packs its input's for stage s-1; the tail
sends receiver-side gradients back, sums the replicas' gradients, runs the one all-reduce (``agreement``) and the
optimizer step, then sends the learned state forward. Every action runs inside ``Transport.during``, so a failure
names its step and action. This computes bit for bit what ``LocalEngine`` does.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import RunConfig
from ..engine import RunData, autocast_ctx, batch_weight, check_projectors, eval_pieces
from ..loop import Evaluation, LoopState, StepOutcome
from ..optimizer_recipe import build_optimizers, set_lr
from ..results import build_results, describe_boundary
from ..stages import build_staged_model
from ..wire import ByteMeter
from .. import boundary_sync as bsync
from .agreement import StepAgreement, nonfinite_place
from .faults import FaultPlan
from .measure import OpTimer, merge_meters, peak_memory, pipeline_section
from .messages import StageMessages
from .rank_checkpoints import RankCheckpoints
from ..schedule import Action, Barrier, Comm, Compute, Kind, Msg, Op, eval_program, step_program
from .topology import Topology
from .transport import Transport

__all__ = ["PipelineEngine"]


class PipelineEngine:
    """One stage of one replica (a ``mapl.core.loop.Engine``); every method is collective over all ranks."""

    def __init__(self, cfg: RunConfig, topo: Topology, data: RunData, transport: Transport, dp_group,
                 ckpt: Path | None, log, info: dict, faults: FaultPlan | None = None):
        self.cfg, self.topo, self.data, self.tx, self.dp_group = cfg, topo, data, transport, dp_group
        self.log, self.info, self.faults = log, info, faults or FaultPlan()
        self.reporter = topo.rank == 0
        self.stage, self.P, self.R = topo.stage, topo.stages, topo.replicas
        t = cfg.train
        self.M, self.T = t.micro_batches, t.seq_len
        _check_replicas(cfg, self.R)
        self.mb_size = t.batch_size // (t.micro_batches * self.R)     # sequences per micro-batch
        self._build_model(data.vocab_size)
        self.meter = ByteMeter()
        self.program, self.tail = step_program(t.schedule, self.P, self.M, self.stage, self.rg_in or self.rg_out,
                                               self._synced_state())
        self.timer = OpTimer(topo.device, self.M)
        self.timing = {"fwd": [], "bwd": [], "wall": []}        # "wait", "opt": the transport's SpanClock
        self.sync_ok: list = []
        self.msg = StageMessages(transport, topo, self.sm, self.comp_in, self.comp_out)
        self.checkpointing = ckpt is not None
        self.ckpts = (RankCheckpoints(ckpt, self.stage, self.P, topo.replica == 0, transport, log)
                      if ckpt is not None else None)

    def _build_model(self, vocab: int) -> None:
        cfg, s, dev = self.cfg, self.stage, self.topo.device
        sm = build_staged_model(cfg, vocab)
        self.model_cfg = sm.model.cfg
        global_params = [(n, p.dtype) for n, p in sm.named_parameters()]
        self.sm = sm.prune_to_stage(s).to(dev)
        self.comp_in = self.sm.boundaries[str(s - 1)] if s > 0 else None
        self.comp_out = self.sm.boundaries[str(s)] if s < self.P - 1 else None
        excluded = {id(p) for p in self.comp_in.parameters()} if self.comp_in is not None else set()
        self.opts = build_optimizers(self.sm, cfg, exclude=excluded)        # the receiver's copy: the sender's job
        gidx = {n: i for i, (n, _) in enumerate(global_params)}
        self.owned = [(gidx[n], p) for n, p in self.sm.named_parameters() if id(p) not in excluded]
        self.rg_in = self.comp_in is not None and self.comp_in.receiver_grad_bytes_per_step() > 0
        self.rg_out = self.comp_out is not None and self.comp_out.receiver_grad_bytes_per_step() > 0
        self.agreement = StepAgreement(global_params, self.owned, self.P, s, self.R, bool(cfg.train.grad_clip), dev)

    # ---- agreement helpers ---------------------------------------------------------------------
    def agree(self, err: str | None) -> None:
        """Raise the same ValueError on every rank if any rank reports an error."""
        errs = self.tx.gather_object(err, "status")
        bad = [f"rank {i}: {e}" for i, e in enumerate(errs) if e]
        if bad:
            raise ValueError("; ".join(bad))

    # ---- checkpoints (mapl.core.loop.Engine) -----------------------------------------------------------
    def resume(self, allow_changes: bool = False) -> LoopState | None:
        if self.ckpts is None:
            return None
        with self.tx.during("checkpoint resume"):
            return self.ckpts.resume(self.cfg, self.sm, self.opts, self.meter, allow_changes, self.agree)

    def save(self, state: LoopState, confirmed: bool = True) -> None:
        self.ckpts.save(self.cfg, self.sm, self.opts, self.meter, state, confirmed)

    def confirm(self) -> None:
        self.ckpts.slot.confirm()

    def drop_unconfirmed(self) -> None:
        self.ckpts.slot.drop_unconfirmed()

    # ---- one training step ---------------------------------------------------------------------
    def train_step(self, step: int, lr_scale: float, stop_requested=lambda: False) -> StepOutcome:
        t0 = time.time()
        self.tx.clock.begin_step()
        self.faults.at_step_start(self.topo.rank, step)
        set_lr(self.opts, lr_scale)
        st = _StepState(self._batch(step), self.topo.device)
        for i, action in enumerate(self.program):
            with self.tx.during(f"step {step} ({_describe(action)})"):
                if isinstance(action, Comm):
                    self._communicate(i, st)
                elif action.kind is Kind.F:
                    self._forward(action.mb, st, step)
                else:
                    self._backward(action.mb, st)
        outcome = self.finish_step(step, st.loss_sum, st.bad_in, st.bad_out, stop_requested)
        fwd_s, bwd_s = self.timer.read()
        self.timing["fwd"].append(fwd_s)
        self.timing["bwd"].append(bwd_s)
        self.tx.clock.end_step()
        self.timing["wall"].append(time.time() - t0)
        return outcome

    def _batch(self, step: int):
        """This replica's share of the step's batch (first and last stages only)."""
        if not (self.topo.first or self.topo.last):
            return None, None
        x, y = self.data.batch(step, self.cfg.train)
        rows = slice(self.topo.replica * self.M * self.mb_size, (self.topo.replica + 1) * self.M * self.mb_size)
        return x[rows].to(self.topo.device), y[rows].to(self.topo.device)

    def _mb(self, tensor, m):
        return tensor[m * self.mb_size:(m + 1) * self.mb_size]

    # -- compute
    def _forward(self, m: int, st: "_StepState", step: int) -> None:
        x, y = st.batch
        ids, z_in = (self._mb(x, m) if self.topo.first else None), None
        payload = None
        if not self.topo.first:
            payload, ids = self.msg.take_fwd(st.inbox.pop(("fwd", m)))
        started = self.timer.start()
        if payload is not None:
            z_in = self.comp_in.unpack(payload, self.msg.in_dtype).requires_grad_()
            st.bad_in |= ~torch.isfinite(z_in.detach()).all()
        with autocast_ctx(self.cfg, self.topo.device):
            if self.topo.last:
                out = self.sm.stage_loss(self.stage, z_in, ids, self._mb(y, m),
                                         self.cfg.train.loss_chunk_tokens) / (self.M * self.R)
            else:
                out = self.sm.stage_forward(self.stage, z_in, ids)
        st.bad_out |= ~torch.isfinite(out.detach()).all()
        if self.topo.last:
            st.loss_sum += out.detach()
        else:
            st.outbox[("fwd", m)] = self.msg.fwd_message(out, ids, self.meter)
        self.timer.stop("F", m, started)
        st.saved[m] = (z_in, out)
        self.faults.after_forward(self.topo.rank, step)

    def _backward(self, m: int, st: "_StepState") -> None:
        z_in, out = st.saved.pop(m)
        grad = None if self.topo.last else self.msg.received(st.inbox.pop(("bwd", m)))
        started = self.timer.start()
        if grad is None:
            out.backward()
        else:
            out.backward(self.comp_out.unpack_grad(grad, out.dtype))
        if not self.topo.first:
            g = z_in.grad if z_in.grad is not None else torch.zeros_like(z_in)
            payload = self.comp_in.pack_grad(g)
            self.meter.add_payload(self.stage - 1, "bwd", payload, self.comp_in.payload_roles("bwd"),
                                   tokens=g.shape[0] * g.shape[1])
            st.outbox[("bwd", m)] = payload
        self.timer.stop("B", m, started)

    def _communicate(self, index: int, st: "_StepState") -> None:
        """Post the batch's receives (non-blocking: and the next batch's), send its messages, then (non-blocking)
        complete the earlier batches' sends."""
        comm = self.program[index]
        self._post_recvs(comm, st)
        held = len(self.tx.pending)
        for t in comm.sends():
            self.msg.send(st.outbox.pop((t.what, t.mb)), self.topo.peer(t.peer), t.what)
        if self.tx.blocking:          # the batch ends when every receive has arrived (rendezvous semantics)
            for t in comm.recvs():
                if t.what is Msg.FWD:
                    self.msg.learn_dtype()
                st.inbox[(t.what, t.mb)] = self.msg.received(st.inbox[(t.what, t.mb)])
        else:                         # look ahead: the next message can arrive while this stage computes
            nxt = next((a for a in self.program[index + 1:] if isinstance(a, Comm)), None)
            if nxt is not None:
                self._post_recvs(nxt, st)
            # one batch later, not at the step's end: at most two sends held (check_programs proves this order)
            self.tx.release(keep=len(self.tx.pending) - held)

    def _post_recvs(self, comm: Comm, st: "_StepState") -> None:
        lead = (self.mb_size, self.T)
        for t in comm.recvs() + list(comm.ahead):
            key = (t.what, t.mb)
            if key in st.inbox:
                continue
            st.inbox[key] = self.msg.post_fwd(lead) if t.what is Msg.FWD else self.msg.post_bwd(lead)

    # -- step end
    def finish_step(self, step: int, loss_sum: torch.Tensor, bad_in: torch.Tensor, bad_out: torch.Tensor,
                    stop_requested=lambda: False) -> StepOutcome:
        """The step's tail once this stage's backwards ran. A non-finite loss ends the step at the barrier on every
        rank alike (all read the same all-reduce). Public: benchmarks/peer_pipelining.py ends torch's schedules'
        steps with it."""
        outcome = None
        for action in self.tail:
            with self.tx.during(f"step {step} ({_describe(action)})"):
                if isinstance(action, Barrier):
                    outcome = self._step_barrier(step, loss_sum, bad_in, bad_out, stop_requested)
                    if not math.isfinite(outcome.loss):
                        return outcome
                elif action.transfers[0].what is Msg.RGRAD:
                    self._exchange_receiver_grads()
                else:
                    self._exchange_state()
        with self.tx.during(f"step {step} (end)"):
            self.tx.flush()
        return outcome

    def _step_barrier(self, step: int, loss_sum, bad_in, bad_out, stop_requested) -> StepOutcome:
        """The sends completed, the replicas' gradients summed, the one all-reduce, then (finite) clipping and the
        optimizer step. The ``opt`` span starts after the flush: the link model adds those waits itself."""
        clock = self.tx.clock
        if not self.rg_in and self.comp_in is not None:     # the receiver's copy learns from the sender only
            for p in self.comp_in.parameters():
                p.grad = None
        self.tx.flush()
        started = clock.start()
        self._sum_replica_grads()
        vec = self.agreement.vector(loss_sum, bad_in, bad_out, stop_requested())
        clock.stop("opt", started)
        self.tx.all_reduce(vec, "grad norms and loss")
        if self.tx.link is not None:        # the all-reduce crosses every boundary up and back
            time.sleep(2 * self.tx.link.latency_s * (self.P - 1))
        loss, stop, flags, mask = self.agreement.read(vec)
        if not math.isfinite(loss):
            return StepOutcome(loss, stop, nonfinite_place(flags))
        started = clock.start()
        if self.cfg.train.grad_clip and self.agreement.N:
            self.agreement.clip(vec, mask, self.cfg.train.grad_clip)
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.comp_out is not None:
            check_projectors({self.stage: self.comp_out}, step)
        clock.stop("opt", started)
        return StepOutcome(loss, stop)

    def _synced_state(self) -> bool:
        comp = self.comp_out if self.comp_out is not None else self.comp_in
        return comp is not None and bool(bsync.state_specs(comp)[0])

    def _exchange_receiver_grads(self) -> None:
        """Receiver-side projector gradients back to the sender (one batch)."""
        sends, recvs = [], []
        if self.rg_in:
            grads = bsync.receiver_grads(self.comp_in)
            bsync.meter_state(self.meter, self.stage - 1, "bwd", grads)
            sends.append((grads, self.topo.prev, "rgrad"))
        if self.rg_out:
            recvs.append((bsync.receiver_grad_specs(self.comp_out), self.topo.next, "rgrad"))
        got = self.tx.exchange(sends, recvs)
        if self.rg_out:
            bsync.add_receiver_grads(self.comp_out, got[0])

    def _sum_replica_grads(self) -> None:
        if self.dp_group is None:
            return
        grads = [p.grad for _, p in self.owned if p.grad is not None]
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            self.tx.all_reduce(flat, "data-parallel gradients", group=self.dp_group)
            for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(new)

    @torch.no_grad()
    def _exchange_state(self) -> None:
        """After the optimizer step: the learned state to the receiver's copy (one batch)."""
        sends, recvs, keys_in = [], [], []
        if self.comp_out is not None:
            keys, tensors = bsync.state_message(self.comp_out)
            if keys:
                bsync.meter_state(self.meter, self.stage, "fwd", tensors)
                sends.append((tensors, self.topo.next, "sync"))
        if self.comp_in is not None:
            keys_in, specs = bsync.state_specs(self.comp_in)
            if keys_in:
                recvs.append((specs, self.topo.prev, "sync"))
        got = self.tx.exchange(sends, recvs)
        if keys_in:
            bsync.apply_state(self.comp_in, keys_in, self.faults.on_sync_received(self.topo.rank, got[0]))

    # ---- evaluation (the same wire, forward only, eval mode) --------------------------------------
    def evaluate(self, step: int) -> Evaluation:
        """The global validation losses, then the state checksums (a warning on mismatch)."""
        val = Evaluation(self._validation_loss(step, self.data.val_batches, "evaluation"),
                         self._validation_loss(step, self.data.select_batches, "selection evaluation")
                         if self.data.select_batches else None)
        self.sync_ok = self.check_sync(step)
        if not all(self.sync_ok):
            self.log(f"warning: shared state differs between sender and receiver at boundaries "
                     f"{[p for p, ok in enumerate(self.sync_ok) if not ok]} (checksum)", file=sys.stderr)
        return val

    @torch.no_grad()
    def _validation_loss(self, step: int, batches: list, what: str) -> float:
        """This stage's part of one evaluation (``eval_program`` over this replica's share); the last stage sums the
        token-weighted losses on the device in float64, read once after the all-reduce."""
        sm, dev = self.sm, self.topo.device
        was = sm.training
        sm.eval()
        pieces = _eval_pieces(batches[self.topo.replica::self.R], batches, self.cfg.train.eval_micro_batch_size)
        total, weight, inbox, outbox = torch.zeros((), dtype=torch.float64, device=dev), 0.0, {}, {}
        vec = torch.zeros(2, dtype=torch.float64, device=dev)
        for action in eval_program(self.P, self.stage, len(pieces)):
            m = _micro_batch(action)
            piece = pieces[m] if m is not None else None
            where = f" (batch {piece.batch}, {_describe(action)})" if piece else ""
            with self.tx.during(f"{what} after step {step}{where}"):
                if isinstance(action, Barrier):
                    vec = torch.stack([total, torch.tensor(weight, dtype=torch.float64, device=dev)])
                    self.tx.all_reduce(vec, "validation loss")
                elif isinstance(action, Compute):
                    loss = self._validation_piece(piece, inbox.pop(m, None), outbox)
                    if loss is not None:            # the last stage
                        total += loss.double() * piece.weight
                        if piece.ends_batch:
                            weight += piece.batch_weight
                elif action.transfers[0].op is Op.RECV:
                    inbox[m] = self.msg.take_fwd(self.msg.post_fwd(tuple(piece.x.shape)))
                else:
                    self.msg.send(outbox.pop(m), self.topo.next, "fwd")
                    if piece.ends_batch:
                        # complete this batch's sends before the next (the whole set's: 19 GiB at 1B uncompressed)
                        self.tx.flush()
        sm.train(was)
        total, weight = vec.tolist()                # the evaluation's one host read
        return total / max(1.0, weight)

    def _validation_piece(self, piece: "_EvalPiece", received, outbox: dict) -> torch.Tensor | None:
        """One evaluation micro-batch through this stage: the last stage's mean loss (on the device), else its
        message for stage s+1 (into ``outbox``)."""
        dev = self.topo.device
        ids, z_in = (piece.x.to(dev) if self.topo.first else None), None
        if received is not None:
            payload, ids = received
            z_in = self.comp_in.unpack(payload, self.msg.in_dtype)
        chunk = self.cfg.train.loss_chunk_tokens
        with autocast_ctx(self.cfg, dev):
            if self.topo.last and chunk:
                return self.sm.stage_loss(self.stage, z_in, ids, piece.y.to(dev), chunk)
            out = self.sm.stage_forward(self.stage, z_in, ids)
        if self.topo.last:
            return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), piece.y.to(dev).reshape(-1))
        outbox[piece.index] = self.msg.fwd_message(out, ids, None)
        return None

    def health(self) -> list[dict] | None:
        """Each boundary's health window from its senders, merged on the reporter (``merge_health``)."""
        mine = self.comp_out.health_report() if self.comp_out is not None else None
        with self.tx.during("the boundaries' health report"):
            everyone = self.tx.gather_object(mine, "health")
        if not self.reporter:
            return None
        return [merge_health([everyone[r * self.P + s] for r in range(self.R)]) for s in range(self.P - 1)]

    def check_sync(self, step: int) -> list[bool]:
        """Per boundary, whether sender and receiver state checksums agree on every replica."""
        sends = [([torch.tensor([self.comp_out.checksum()], dtype=torch.int64)], self.topo.next, "check")] \
            if self.comp_out is not None else []
        recvs = [([((1,), torch.int64)], self.topo.prev, "check")] if self.comp_in is not None else []
        with self.tx.during(f"checksum after step {step}"):
            got = self.tx.exchange(sends, recvs)
            self.tx.flush()
            ok = int(got[0][0][0]) == self.comp_in.checksum() if recvs else None
            everyone = self.tx.gather_object(ok, "checksums")
        return [all(everyone[r * self.P + s] for r in range(self.R)) for s in range(1, self.P)]

    # ---- results (gathered to rank 0) --------------------------------------------------------------
    def results(self, state: LoopState, wall_s: float) -> dict | None:
        if not self.sync_ok:
            self.sync_ok = self.check_sync(state.step)
        id_bytes = self.sm.id_bytes_per_token()
        timing = {**self.timing, **self.tx.clock.collect(block=True)}      # every step's spans, read
        mine = {"meter": self.meter.state_dict(), "timing": timing,
                "boundary": (describe_boundary(self.comp_out, self.stage, self.cfg, id_bytes, replicas=self.R)
                             if self.comp_out is not None and self.topo.replica == 0 else None),
                "n_params": sum(p.numel() for _, p in self.owned) if self.topo.replica == 0 else 0,
                "pid": os.getpid(), "host": socket.gethostname(), "peak_memory": peak_memory(self.topo.device),
                "held_sends": self.tx.held_peak}
        with self.tx.during("the results"):
            everyone = self.tx.gather_object(mine, "results")
        if not self.reporter:
            return None
        merged = merge_meters([r["meter"] for r in everyone])
        boundaries = [r["boundary"] for r in everyone[:self.P - 1]]
        res = build_results(self.cfg, state, boundaries, merged, d_model=self.model_cfg.d_model,
                            id_bytes_per_token=id_bytes, n_params=sum(r["n_params"] for r in everyone),
                            manifest=self.data.manifest, wall_s=wall_s)
        res["runtime"] = "multiprocess"
        res["schedule"] = self.cfg.train.schedule
        res["pipeline"] = pipeline_section(schedule=self.cfg.train.schedule, everyone=everyone, merged=merged,
                                           boundaries=boundaries, steps=state.step, M=self.M, replicas=self.R,
                                           info={**self.info, "state_checksum_match": self.sync_ok},
                                           link=self.tx.link)
        return res


def merge_health(replicas: list[dict]) -> dict:
    """One boundary's health over replicas: ``*_max`` entries the maxima, the rest replica 0's."""
    out = dict(replicas[0])
    for key in out:
        if key.endswith("_max"):
            vals = [r[key] for r in replicas if r.get(key) is not None]
            out[key] = max(vals) if vals else None
    return out


def _check_replicas(cfg: RunConfig, replicas: int) -> None:
    if replicas == 1:
        return
    t = cfg.train
    if t.batch_size % (t.micro_batches * replicas):
        raise ValueError(f"train.batch_size={t.batch_size} is invalid with {replicas} data-parallel replicas: must "
                         f"be a multiple of train.micro_batches x replicas = {t.micro_batches * replicas}")
    if cfg.compressor.method == "mapl-rvq":
        raise ValueError("compressor.method='mapl-rvq' cannot run with data-parallel replicas yet: each replica "
                         "would update its own codebooks (their EMA statistics need an all-reduce); use one replica")


class _StepState:
    """What one step carries between its actions; the loss and non-finite flags stay on the device."""

    def __init__(self, batch, device):
        self.batch = batch
        self.inbox: dict = {}            # (what, mb) -> pending receive, or the received tensors
        self.outbox: dict = {}           # (what, mb) -> tensors to send
        self.saved: dict = {}            # mb -> (input with grad, output)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.bad_in = torch.zeros((), dtype=torch.bool, device=device)
        self.bad_out = torch.zeros((), dtype=torch.bool, device=device)


def _describe(action: Action) -> str:
    """An action as errors name it: "F3", "send fwd 3 to stage 2", "step all-reduce"."""
    if isinstance(action, Compute):
        return f"{action.kind}{action.mb}"
    if isinstance(action, Barrier):
        return action.name
    return ", ".join(f"{t.op} {t.what}{'' if t.mb < 0 else f' {t.mb}'} {'to' if t.op is Op.SEND else 'from'} "
                     f"stage {t.peer}" for t in action.transfers)


def _micro_batch(action: Action) -> int | None:
    """The micro-batch an action works on (None: a barrier)."""
    if isinstance(action, Compute):
        return action.mb
    if isinstance(action, Comm):
        return action.transfers[0].mb
    return None


@dataclass(frozen=True)
class _EvalPiece:
    """One evaluation micro-batch: its place in the program, tensors and weight in the mean."""
    index: int
    batch: int                   # the validation batch it belongs to (this replica's count)
    x: torch.Tensor
    y: torch.Tensor
    weight: float                # the batch's weight x the piece's share of its tokens
    batch_weight: float
    ends_batch: bool


def _eval_pieces(mine: list, batches: list, seqs: int) -> list[_EvalPiece]:
    """This replica's validation batches ``mine`` cut into evaluation micro-batches."""
    out = []
    for b, (x, y) in enumerate(mine):
        bw = batch_weight(y, batches)
        cut = list(eval_pieces(x, y, seqs))
        out += [_EvalPiece(len(out) + k, b, xi, yi, bw * share, bw, k == len(cut) - 1)
                for k, (xi, yi, share) in enumerate(cut)]
    return out
