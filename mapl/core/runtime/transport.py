"""Point-to-point messages between neighbouring stages: each a list of tensors sent as ONE flat byte buffer (any
dtype crosses gloo and NCCL alike), received into a buffer allocated from ``Compressor.payload_spec``.

Non-blocking (default): ``isend``s completed one batch later (``release``) or at the step's end (``flush``), so a
stage holds at most two sends; receives posted ahead. Nothing synchronises the device, so communication overlaps
compute. Blocking (tests): ``dist.send`` meets its receive as NCCL does, so a schedule that would deadlock on NCCL
deadlocks on CPU too. Each direction has its own process group (on NCCL its own communicator and stream). The
real-delay mode (``link``) stamps each message with its send time and sleeps the receiver until it would have
arrived over the link (the virtual clock's channel model; one host only).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...base.cli import PeerFailure
from ..compress.base import spec_bytes
from ..link import LinkProfile
from .measure import SpanClock

__all__ = ["CommError", "Transport", "PendingRecv", "TAGS"]

# gloo matches messages by source and tag; NCCL by order, which the schedule checker verifies
TAGS = {"fwd": 1, "bwd": 2, "rgrad": 3, "sync": 4, "meta": 5, "check": 6}
_NAMES = {"fwd": "forward activations", "bwd": "gradients", "rgrad": "receiver-side projector gradient",
          "sync": "state sync", "meta": "dtype handshake", "check": "state checksum"}
_FORWARD_KINDS = ("fwd", "sync", "meta", "check")       # travel s -> s+1; the rest s+1 -> s


class CommError(PeerFailure):
    """A communication failed: a peer died, or the timeout expired."""


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class PendingRecv:
    work: object
    buf: torch.Tensor
    specs: list
    peer: int
    what: str
    stamped: bool


class Transport:
    """Messages of one stage to and from its neighbours (global ranks ``prev``/``next``, or None)."""

    def __init__(self, rank: int, prev: int | None, next_: int | None, device: torch.device, timeout_s: float,
                 link: LinkProfile | None = None, blocking: bool = False, world_group=None, stages: int = 0):
        self.rank, self.prev, self.next, self.device = rank, prev, next_, device
        self.stages = stages or 1 << 30              # names peers by stage (rank = stage without replicas)
        self.timeout_s, self.link, self.blocking = timeout_s, link, blocking
        tmo = timedelta(seconds=timeout_s)
        self.groups = {"fwd": dist.new_group(timeout=tmo), "bwd": dist.new_group(timeout=tmo)}
        self.world = world_group if world_group is not None else self.groups["fwd"]
        self.pending: list = []              # (work, buffer) of sends in flight, oldest first
        self.held_peak = (0, 0)              # the most sends, and send-buffer bytes, held at once (tests bound them)
        self.clock = SpanClock(device)       # "wait": blocked in communication, on the device where it has clocks
        self._doing = "setup"                 # what this stage is doing: named by every error (``during``)
        self._chan_free = defaultdict(float)     # sender -> when its channel to us is free (delay mode)

    # -- errors
    @contextmanager
    def during(self, doing: str):
        """Name what the stage does inside the block (``"step 12 (F3)"``): a failure inside says so."""
        outer, self._doing = self._doing, doing
        try:
            yield
        finally:
            self._doing = outer

    def _fail(self, what: str, e: Exception):
        raise CommError(f"{what} failed during {self._doing}: a peer stage died or did not answer within the "
                        f"{self.timeout_s:g} s process-group timeout ({type(e).__name__}: {str(e).strip()[:300]})") from e

    def _peer(self, peer: int) -> str:
        stage = peer % self.stages
        return f"stage {stage}" + ("" if stage == peer else f" (rank {peer})")

    def _group(self, what: str):
        return self.groups["fwd" if what in _FORWARD_KINDS else "bwd"]

    # -- sending
    def send(self, tensors: list[torch.Tensor], peer: int, what: str) -> None:
        """One message: blocking returns once the peer has it; else it completes in ``release``/``flush``."""
        parts = [_raw(t.to(self.device)) for t in tensors]
        if self.link is not None:
            parts.insert(0, _raw(torch.tensor([time.time()], dtype=torch.float64, device=self.device)))
        buf = parts[0] if len(parts) == 1 else torch.cat(parts)
        t0 = self.clock.start()
        try:
            if self.blocking:
                dist.send(buf, peer, group=self._group(what), tag=TAGS[what])
            else:
                self.pending.append((dist.isend(buf, peer, group=self._group(what), tag=TAGS[what]), buf))
                held = (len(self.pending), sum(b.numel() for _, b in self.pending))
                self.held_peak = tuple(max(a, b) for a, b in zip(self.held_peak, held))
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure here
            self._fail(f"send of {_NAMES[what]} to {self._peer(peer)}", e)
        self.clock.stop("wait", t0)

    # -- receiving
    def post(self, specs: list, peer: int, what: str) -> PendingRecv:
        """Post a receive of tensors of ``specs`` [(shape, dtype)]; ``wait`` it later."""
        stamped = self.link is not None
        buf = torch.empty(spec_bytes(specs) + (8 if stamped else 0), dtype=torch.uint8, device=self.device)
        try:
            work = dist.irecv(buf, peer, group=self._group(what), tag=TAGS[what])
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure (_fail names it)
            self._fail(f"receive of {_NAMES[what]} from {self._peer(peer)}", e)
        return PendingRecv(work, buf, list(specs), peer, what, stamped)

    def wait(self, rx: PendingRecv) -> list[torch.Tensor]:
        t0 = self.clock.start()
        try:
            rx.work.wait()
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure (_fail names it)
            self._fail(f"receive of {_NAMES[rx.what]} from {self._peer(rx.peer)}", e)
        buf = rx.buf
        if rx.stamped:
            self._emulate_link(rx.peer, float(buf[:8].clone().view(torch.float64)[0]), buf.numel() - 8)
            buf = buf[8:]
        self.clock.stop("wait", t0)
        out, off = [], 0
        for shape, dt in rx.specs:
            n = spec_bytes([(shape, dt)])
            out.append(buf[off:off + n].clone().view(dt).reshape(shape))   # clone: a slice may be misaligned
            off += n
        return out

    def _emulate_link(self, peer: int, sent: float, nbytes: int) -> None:
        """Sleep until the message would have arrived over the FIFO channel (the virtual clock's model)."""
        start = max(sent, self._chan_free[peer])
        self._chan_free[peer] = start + self.link.transfer_s(nbytes)
        delay = self._chan_free[peer] + self.link.latency_s - time.time()
        if delay > 0:
            time.sleep(delay)

    # -- batches and step end
    def exchange(self, sends: list[tuple[list[torch.Tensor], int, str]], recvs: list[tuple[list, int, str]]) -> list:
        """One batch: post ``recvs`` [(specs, peer, what)], send ``sends`` [(tensors, peer, what)]; the received."""
        posted = [self.post(specs, peer, what) for specs, peer, what in recvs]
        for tensors, peer, what in sends:
            self.send(tensors, peer, what)
        return [self.wait(rx) for rx in posted]

    def flush(self) -> None:
        self.release(keep=0)

    def release(self, keep: int) -> None:
        """Complete the sends in flight but the ``keep`` newest and drop their buffers (on NCCL the wait orders the
        stream after the send, no host block)."""
        cut = max(0, len(self.pending) - keep)
        done, self.pending = self.pending[:cut], self.pending[cut:]
        t0 = self.clock.start()
        try:
            for work, _ in done:
                work.wait()
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure (_fail names it)
            self.pending = []
            self._fail("completing sends to the neighbour stages", e)
        finally:
            self.clock.stop("wait", t0)

    # -- collectives over every rank
    def all_reduce(self, t: torch.Tensor, what: str, group=None) -> torch.Tensor:
        t0 = self.clock.start()
        try:
            dist.all_reduce(t, group=group or self.world)
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure (_fail names it)
            self._fail(f"all-reduce of {what}", e)
        self.clock.stop("wait", t0)
        return t

    def gather_object(self, obj, what: str) -> list:
        out = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(out, obj, group=self.world)
        except Exception as e:          # noqa: BLE001 -- any backend error is a comm failure (_fail names it)
            self._fail(f"all-gather of {what}", e)
        return out
