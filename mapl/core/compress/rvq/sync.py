"""How the receiver's copy of the RVQ codebooks follows the sender's; the tensors ride on every forward message
after the header, in fixed shapes. ``stream`` (the paper's): n codewords of every codebook per message along a
seeded random permutation (the k-means init message: the whole codebook, once); ``full``: the whole codebook
every message; ``mirrored``: the receiver repeats the sender's EMA update from the per-code sums and revivals.
A strategy is a module so its bookkeeping travels in checkpoints; a message is applied without a host read.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn

from ...seeds import derive_seed
from .codebook import OP_INIT, DeviceFlag, ResidualVQ, to_device_async

__all__ = ["CodebookSync", "StreamSync", "FullSync", "MirroredSync", "SYNC_STRATEGIES", "make_sync"]

Spec = list[tuple[tuple[int, ...], torch.dtype]]


class CodebookSync(nn.Module):
    """``spec``/``sender_tensors`` on the sending side, ``apply`` on the receiving one (or the sender's shadow)."""

    name: ClassVar[str]

    def __init__(self, q: ResidualVQ):
        super().__init__()
        G, R, K = q.groups, q.rounds, q.codebook_size
        self.shape = (G, R, K, q.sub_dim)
        self.dtype = q.codebooks.dtype
        self.register_buffer("code_version", torch.zeros(G, R, K, dtype=torch.int64, device="cpu"))
        self.register_buffer("seen_version", torch.zeros((), dtype=torch.int64, device="cpu"))
        self._gap = DeviceFlag()   # a mirrored version gap (a lost or reordered message), raised on the device

    @property
    def desync(self) -> bool:
        return self._gap.read()

    def get_extra_state(self):
        return {"desync": self.desync}

    def set_extra_state(self, state) -> None:
        self._gap = DeviceFlag(state["desync"])

    def default_max_staleness(self) -> int:
        return 0

    def spec(self, with_init: bool = False) -> Spec:
        raise NotImplementedError

    def sender_tensors(self, sender: ResidualVQ, op: dict | None) -> list[torch.Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def apply(self, receiver: ResidualVQ, version: int | torch.Tensor, op: int, tensors: list[torch.Tensor],
              idx: torch.Tensor) -> None:
        """Apply one message's sync tensors (idempotent for stream and full). ``version``: a host int (the
        sender's shadow) or the header's 0-d device tensor (a receiver: never read)."""
        v = self._version_tensor(version)
        self._write(receiver, v, op, tensors, idx)
        if op == OP_INIT:
            receiver.mark_initted()
        self.seen_version.copy_(torch.maximum(self.seen_version, v))

    def _version_tensor(self, version: int | torch.Tensor) -> torch.Tensor:
        dev = self.seen_version.device
        if isinstance(version, torch.Tensor):
            return version.to(device=dev, dtype=torch.int64)
        return to_device_async(torch.tensor(version, dtype=torch.int64, device="cpu"), dev)

    def _write(self, receiver: ResidualVQ, version: torch.Tensor, op: int, tensors: list[torch.Tensor],
               idx: torch.Tensor):
        raise NotImplementedError

    def staleness(self, receiver: ResidualVQ) -> int:
        """Versions the receiver's copy is behind the newest sender version it has heard of (one host read)."""
        return int(self.seen_version - self.code_version.min())


class StreamSync(CodebookSync):
    name = "stream"

    def __init__(self, q: ResidualVQ, stream_fraction: float | None = None):
        super().__init__(q)
        K = q.codebook_size
        if stream_fraction is not None and not 0.0 < stream_fraction <= 1.0:
            raise ValueError(f"stream_fraction={stream_fraction!r} is invalid; allowed: 0 < f <= 1")
        self.n = 1 if stream_fraction is None else max(1, min(K, round(stream_fraction * K)))
        self.cycle = -(-K // self.n)
        self._gen = torch.Generator().manual_seed(derive_seed(q.seed, "rvq_stream"))
        self.register_buffer("perm", self._new_perm())
        self.register_buffer("cursor", torch.zeros((), dtype=torch.int64, device="cpu"))
        self._cursor = 0           # host mirror of cursor

    def get_extra_state(self):
        return {**super().get_extra_state(), "gen": self._gen.get_state()}

    def set_extra_state(self, state) -> None:
        super().set_extra_state(state)
        self._gen.set_state(state["gen"])
        self._cursor = int(self.cursor)

    def default_max_staleness(self) -> int:
        # every codeword is refreshed once per cycle: at most 2 * cycle - 2 versions behind while learning
        return 2 * self.cycle

    def _new_perm(self) -> torch.Tensor:
        G, R, K, _ = self.shape
        return torch.rand(G, R, K, generator=self._gen, device="cpu").argsort(dim=-1)

    def spec(self, with_init: bool = False) -> Spec:
        G, R, K, ds = self.shape
        n = K if with_init else self.n
        return [((G, R, n), torch.int32), ((G, R, n, ds), self.dtype)]

    def _slice(self) -> torch.Tensor:
        K, n = self.shape[2], self.n
        c = self._cursor
        cols = (c * n + torch.arange(n, device=self.perm.device)) % K
        pos = self.perm[..., cols]
        self._cursor = 0 if c + 1 >= self.cycle else c + 1
        self.cursor.fill_(self._cursor)
        if self._cursor == 0:
            self.perm.copy_(to_device_async(self._new_perm(), self.perm.device))
        return pos

    def sender_tensors(self, sender, op):
        cb = sender.codebooks
        if op is not None and op["op"] == OP_INIT:          # every codeword moved: send them all, once
            G, R, K, _ = self.shape
            pos = torch.arange(K, dtype=torch.int32, device=cb.device).expand(G, R, K).contiguous()
            return [pos, cb.detach().clone()]
        pos = self._slice()
        val = cb.gather(2, pos.unsqueeze(-1).expand(*pos.shape, cb.shape[-1]))
        return [pos.to(torch.int32).contiguous(), val.contiguous()]

    def _write(self, receiver, version, op, tensors, idx):
        pos, val = tensors
        rc = receiver.codebooks
        p = pos.long().to(rc.device)
        rc.scatter_(2, p.unsqueeze(-1).expand(*p.shape, rc.shape[-1]), val.to(rc))
        self.code_version.scatter_(2, p, version.expand(p.shape))


class FullSync(CodebookSync):
    name = "full"

    def spec(self, with_init: bool = False) -> Spec:
        return [(self.shape, self.dtype)]

    def sender_tensors(self, sender, op):
        return [sender.codebooks.detach().clone()]

    def _write(self, receiver, version, op, tensors, idx):
        receiver.codebooks.copy_(tensors[0])
        self.code_version.copy_(version.expand(self.code_version.shape))


class MirroredSync(CodebookSync):
    name = "mirrored"

    def __init__(self, q: ResidualVQ):
        super().__init__(q)
        self.max_revive = q.max_revive

    def spec(self, with_init: bool = False) -> Spec:
        G, R, K, ds = self.shape
        M = self.max_revive
        return [(self.shape, self.dtype), ((G, R, M), torch.int32), ((G, R, M, ds), self.dtype)]

    def sender_tensors(self, sender, op):
        cb = sender.codebooks
        if op is None:
            return [torch.zeros_like(cb), *sender.no_revivals()]
        return [op["stat"].to(cb.dtype).contiguous(), op["rpos"].to(torch.int32).contiguous(),
                op["rval"].to(cb.dtype).contiguous()]

    def _write(self, receiver, version, op, tensors, idx):
        stat, rpos, rval = tensors
        rc = receiver.codebooks
        receiver.mirror(op, stat.to(rc), rpos.to(rc.device), rval.to(rc), idx)
        self._gap.raise_if(receiver.version.to(version.device) != version)    # read by `desync`, when asked
        self.code_version.fill_(receiver.host_version)

    def staleness(self, receiver: ResidualVQ) -> int:
        return int(self.seen_version) - receiver.host_version


SYNC_STRATEGIES: dict[str, type[CodebookSync]] = {c.name: c for c in (StreamSync, FullSync, MirroredSync)}


def make_sync(mode: str, q: ResidualVQ, stream_fraction: float | None = None) -> CodebookSync:
    if mode not in SYNC_STRATEGIES:
        raise ValueError(f"sync={mode!r} is invalid; allowed: {', '.join(map(repr, SYNC_STRATEGIES))}")
    if mode == "stream":
        return StreamSync(q, stream_fraction)
    if stream_fraction is not None:
        raise ValueError(f"stream_fraction={stream_fraction!r} is only used by sync='stream', not {mode!r}")
    return SYNC_STRATEGIES[mode](q)
