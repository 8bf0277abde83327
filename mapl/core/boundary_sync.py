"""State that crosses a boundary once per step, for both engines: before the optimizer step the receiver-side
gradient of a learned projector goes back to the sender; after it the learned state (A, fp32) goes forward to the
receiver's copy; now and then both compare a checksum. In one process nothing moves but the same bytes are
metered, so both runtimes report the same totals."""
from __future__ import annotations

import torch

from .compress.base import payload_bytes
from .wire import ByteMeter

__all__ = ["receiver_grads", "receiver_grad_specs", "add_receiver_grads", "state_message", "state_specs",
           "apply_state", "meter_state", "meter_local_step"]


def receiver_grads(comp) -> list[torch.Tensor]:
    """Receiver side: the step's receiver-side gradient taken out of the copy's parameters, fp32, one per parameter."""
    comp.fold_receiver_grad()
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float().clone() for p in comp.parameters()]
    for p in comp.parameters():
        p.grad = None
    return grads


def receiver_grad_specs(comp) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(p.shape), torch.float32) for p in comp.parameters()]


def add_receiver_grads(comp, grads: list[torch.Tensor]) -> None:
    for p, g in zip(comp.parameters(), grads, strict=True):
        g = g.to(p.dtype)
        p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def state_message(comp) -> tuple[list[str], list[torch.Tensor]]:
    """Sender side: the learned state, in a fixed key order."""
    payload = comp.sync_payload()
    keys = sorted(payload)
    return keys, [payload[k].detach().clone() for k in keys]


def state_specs(comp) -> tuple[list[str], list]:
    """Receiver side: the state message's shapes and dtypes, from its own copy."""
    mine = comp.sync_payload()
    keys = sorted(mine)
    return keys, [(tuple(mine[k].shape), mine[k].dtype) for k in keys]


@torch.no_grad()
def apply_state(comp, keys: list[str], tensors: list[torch.Tensor]) -> None:
    comp.apply_sync({k: v.clone() for k, v in zip(keys, tensors, strict=True)})


def meter_state(meter: ByteMeter, boundary: int, direction: str, tensors_or_bytes) -> None:
    n = tensors_or_bytes if isinstance(tensors_or_bytes, int) else payload_bytes(tensors_or_bytes)
    meter.add(boundary, direction, "state", n)


@torch.no_grad()
def meter_local_step(comps: list, meter: ByteMeter) -> None:
    """One process: the receiver's copy is the sender's object, but both exchanges' bytes are booked."""
    for p, comp in enumerate(comps):
        keys, tensors = state_message(comp)
        if keys:
            apply_state(comp, keys, tensors)
            meter_state(meter, p, "fwd", tensors)
        rg = comp.receiver_grad_bytes_per_step()
        if rg:
            meter_state(meter, p, "bwd", rg)
