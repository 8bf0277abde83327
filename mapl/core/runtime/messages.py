"""A stage's messages: a forward's payload (plus token ids when a later anchor needs them), what a receiver
allocates, and the one-time dtype handshake (the sender says once which float dtype its stage produces)."""
from __future__ import annotations

import torch

from ..wire import ByteMeter
from .transport import PendingRecv, Transport

__all__ = ["StageMessages", "DTYPE_CODES"]

DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]     # the handshake's codes


class StageMessages:
    def __init__(self, tx: Transport, topo, sm, comp_in, comp_out):
        self.tx, self.topo, self.sm, self.comp_in, self.comp_out = tx, topo, sm, comp_in, comp_out
        self.in_dtype: torch.dtype | None = None       # learned from the sender's handshake
        self._meta_rx: PendingRecv | None = None
        self._out_dtype: torch.dtype | None = None
        self._dtype_sent = False
        self._fwd_pending = 0                          # forward receives posted and not yet taken

    # -- sender side
    def fwd_message(self, out: torch.Tensor, ids: torch.Tensor, meter: ByteMeter | None) -> list[torch.Tensor]:
        """The forward message of this stage's output (metered when ``meter`` is given)."""
        comp = self.comp_out
        comp.observe(out)
        payload = comp.pack(out)
        if meter is not None:
            meter.add_payload(self.topo.stage, "fwd", payload, comp.payload_roles("fwd"),
                              tokens=out.shape[0] * out.shape[1])
        msg = list(payload)
        if self.sm.ids_on_wire:
            wire_ids = ids.to(self.sm.id_dtype)
            msg.append(wire_ids)
            if meter is not None:
                meter.add(self.topo.stage, "fwd", "ids", wire_ids.numel() * wire_ids.element_size())
        self._out_dtype = out.dtype
        return msg

    def send(self, tensors: list[torch.Tensor], peer: int, what: str) -> None:
        if what == "fwd" and not self._dtype_sent:        # once per run, first on the forward channel
            code = torch.tensor([DTYPE_CODES.index(self._out_dtype)], dtype=torch.int64)
            self.tx.send([code], peer, "meta")
            self._dtype_sent = True
        self.tx.send(tensors, peer, what)

    # -- receiver side
    def fwd_specs(self, lead: tuple[int, int]) -> list:
        specs = self.comp_in.payload_spec(lead, "fwd", pending=self._fwd_pending)
        return specs + [(lead, self.sm.id_dtype)] if self.sm.ids_on_wire else specs

    def post_fwd(self, lead: tuple[int, int]) -> PendingRecv:
        if self.in_dtype is None and self._meta_rx is None:
            self._meta_rx = self.tx.post([((1,), torch.int64)], self.topo.prev, "meta")
        rx = self.tx.post(self.fwd_specs(lead), self.topo.prev, "fwd")
        self._fwd_pending += 1
        return rx

    def post_bwd(self, lead: tuple[int, int]) -> PendingRecv:
        return self.tx.post(self.comp_out.payload_spec(lead, "bwd"), self.topo.next, "bwd")

    def learn_dtype(self) -> None:
        if self.in_dtype is None:
            (code,) = self.tx.wait(self._meta_rx)
            self.in_dtype = DTYPE_CODES[int(code[0])]

    def received(self, rx) -> list[torch.Tensor]:
        """The tensors of a receive, waiting for it if still pending."""
        return rx if isinstance(rx, list) else self.tx.wait(rx)

    def take_fwd(self, rx) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(the compressor's payload, the token ids or None) of a forward message."""
        self.learn_dtype()
        got = self.received(rx)
        self._fwd_pending -= 1
        n = len(got) - (1 if self.sm.ids_on_wire else 0)
        ids = None
        if self.sm.ids_on_wire:
            ids = got[n].to(torch.int64)
            if self.sm.id_dtype == torch.int16:
                ids = ids & 0xFFFF
        return got[:n], ids
