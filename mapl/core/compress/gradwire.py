"""The backward message of the projection methods: the r-wide gradient on z, on the wire.

``same`` (the default, the paper's): the values in the forward wire's float dtype (bf16), 2r bytes per token.
``int8``: int8 codes with one absmax fp16 scale per token, r + 2 bytes. The gradient is quantised on the wire
only (``pack_grad``), so the one-process pipeline (``WireTransfer``) and the multi-process runtime compute
the same numbers, and the declared bytes are the metered ones.
"""
from __future__ import annotations

import torch

from .absmax import SCALE_DTYPE, absmax_dequantize, absmax_quantize

__all__ = ["spec", "pack", "unpack", "floor_bits"]


def spec(kind: str, lead_shape: tuple[int, ...], width: int, float_dtype: torch.dtype) -> list:
    """Shapes and dtypes of one backward payload for ``lead_shape`` = (B, T)."""
    if kind == "int8":
        return [((*lead_shape, width), torch.int8), ((*lead_shape, 1), SCALE_DTYPE)]
    return [((*lead_shape, width), float_dtype)]


def pack(kind: str, g: torch.Tensor, float_dtype: torch.dtype) -> list[torch.Tensor]:
    if kind == "int8":
        return list(absmax_quantize(g, 0))
    return [g.detach().to(float_dtype).contiguous()]


def unpack(kind: str, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if kind == "int8":
        return absmax_dequantize(payload[0], payload[1], dtype)
    return payload[0].to(dtype)


def floor_bits(kind: str, width: int, float_dtype: torch.dtype) -> float:
    """Bits per token the backward message cannot do without."""
    if kind == "int8":
        return float(8 * width + torch.finfo(SCALE_DTYPE).bits)
    return float(width * torch.finfo(float_dtype).bits)
