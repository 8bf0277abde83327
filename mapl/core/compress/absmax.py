"""8-bit absmax quantisation: int8 codes and one fp16 scale per row (or per block); the int8 method and the int8 gradient wire."""
from __future__ import annotations

import torch

__all__ = ["SCALE_DTYPE", "absmax_quantize", "absmax_dequantize"]

SCALE_DTYPE = torch.float16      # 2-byte scales; absmax/127 of bf16-range activations fits fp16 comfortably


def absmax_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> int8 codes (..., d), scales (..., d // block); block 0: one scale per row."""
    d = x.shape[-1]
    blk = block or d
    xb = x.detach().float().reshape(*x.shape[:-1], d // blk, blk)
    scale = (xb.abs().amax(dim=-1, keepdim=True) / 127.0).to(SCALE_DTYPE).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(xb, safe).round_().clamp_(-127, 127).to(torch.int8)    # in place: one temporary, not three
    return q.reshape(x.shape), scale.squeeze(-1).to(SCALE_DTYPE)


def absmax_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = q.shape[-1]
    nb = scale.shape[-1]
    xb = q.float().reshape(*q.shape[:-1], nb, d // nb).mul_(scale.float().unsqueeze(-1))
    return xb.reshape(q.shape).to(dtype)
