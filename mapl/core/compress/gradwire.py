"""The projection methods' backward message (``compressor.grad_wire``): ``same`` sends dL/dz in the forward
wire's float dtype (2r bytes per token, the paper's); ``int8`` absmax codes with one fp16 scale per token (r + 2)."""
from __future__ import annotations

import torch

from .absmax import SCALE_DTYPE, absmax_dequantize, absmax_quantize

__all__ = ["spec", "pack", "unpack", "floor_bits"]


def spec(kind: str, lead_shape: tuple[int, ...], width: int, float_dtype: torch.dtype) -> list:
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
    if kind == "int8":
        return float(8 * width + torch.finfo(SCALE_DTYPE).bits)
    return float(width * torch.finfo(float_dtype).bits)
