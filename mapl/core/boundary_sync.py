"""State that crosses a boundary once per step, shared by both engines.

A boundary p has a sender (stage p) and a receiver (stage p+1), each with its own copy of the
compressor (one object when both stages live in one process). Per step:

1. before the optimizer step, the **receiver-side gradient** of a learned projector (the decode
   side's term of dL/dA, accumulated over the micro-batches) goes back to the sender, which adds it
   to its own A.grad (``receiver_grads`` / ``add_receiver_grads``; fp32, d x r);
2. after the optimizer step, the **learned state** (A) goes forward to the receiver's copy
   (``state_message`` / ``apply_state``; fp32, so AᵀA = I survives the trip);
3. now and then both sides compare a **checksum** of that state (``checksum``), which detects a
   receiver copy that drifted. RVQ codebooks travel piggybacked on the activations (the
   compressor's ``pack``), not here.

The meter books both exchanges as "state" bytes; in one process (``meter_local_step``) nothing
moves but the same bytes are booked, so both runtimes report the same totals.
"""
from __future__ import annotations

import torch

from .wire import ByteMeter

__all__ = ["receiver_grads", "receiver_grad_specs", "add_receiver_grads", "state_message", "state_specs",
           "apply_state", "checksum", "meter_state", "meter_local_step"]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def receiver_grads(comp) -> list[torch.Tensor]:
    """Receiver side: fold the step's receiver-side gradient into the copy's parameters, take it out
    (the copy is not optimised here) and return it as fp32 tensors, one per parameter."""
    comp.fold_receiver_grad()
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float().clone() for p in comp.parameters()]
    for p in comp.parameters():
        p.grad = None
    return grads


def receiver_grad_specs(comp) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(p.shape), torch.float32) for p in comp.parameters()]


def add_receiver_grads(comp, grads: list[torch.Tensor]) -> None:
    """Sender side: add the gradient the receiver computed to the owner's parameters."""
    for p, g in zip(comp.parameters(), grads, strict=True):
        g = g.to(p.dtype)
        p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def state_message(comp) -> tuple[list[str], list[torch.Tensor]]:
    """Sender side, after the optimizer step: the learned state, in a fixed key order."""
    payload = comp.sync_payload()
    keys = sorted(payload)
    return keys, [payload[k].detach().clone() for k in keys]


def state_specs(comp) -> tuple[list[str], list]:
    """Receiver side: the shapes and dtypes of the state message (from the receiver's own copy)."""
    mine = comp.sync_payload()
    keys = sorted(mine)
    return keys, [(tuple(mine[k].shape), mine[k].dtype) for k in keys]


@torch.no_grad()
def apply_state(comp, keys: list[str], tensors: list[torch.Tensor]) -> None:
    comp.apply_sync({k: v.clone() for k, v in zip(keys, tensors, strict=True)})


def checksum(comp) -> int:
    return int(comp.checksum())


def meter_state(meter: ByteMeter, boundary: int, direction: str, tensors_or_bytes) -> None:
    n = tensors_or_bytes if isinstance(tensors_or_bytes, int) else _nbytes(tensors_or_bytes)
    meter.add(boundary, direction, "state", n)


@torch.no_grad()
def meter_local_step(comps: list, meter: ByteMeter) -> None:
    """One process: the receiver's copy is the sender's object, so applying the state is a no-op, but
    the bytes both exchanges would carry are booked as in the multi-process runtime."""
    for p, comp in enumerate(comps):
        keys, tensors = state_message(comp)
        if keys:
            apply_state(comp, keys, tensors)
            meter_state(meter, p, "fwd", tensors)
        rg = comp.receiver_grad_bytes_per_step()
        if rg:
            meter_state(meter, p, "bwd", rg)
