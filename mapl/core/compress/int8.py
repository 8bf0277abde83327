"""8-bit absmax quantisation of both legs on the wire (the SWARM / hivemind peer, 2x vs bf16)."""
from __future__ import annotations

import torch

from .absmax import SCALE_DTYPE, absmax_dequantize, absmax_quantize
from .base import Compressor, _check_direction

__all__ = ["Int8Compressor"]


class Int8Compressor(Compressor):
    method = "int8"

    def __init__(self, d_model: int, block: int = 0):
        super().__init__(d_model)
        self.block = block                 # 0, or a divisor of d_model (the config checks it)

    def _n_scales(self) -> int:
        return self.d_model // self.block if self.block else 1

    def pack(self, z):
        return list(absmax_quantize(z, self.block))

    def unpack(self, payload, dtype):
        return absmax_dequantize(payload[0], payload[1], dtype)

    pack_grad = pack
    unpack_grad = unpack

    def payload_spec(self, lead_shape, direction, pending=0):
        return [((*lead_shape, self.d_model), torch.int8), ((*lead_shape, self._n_scales()), SCALE_DTYPE)]

    def wire_efficiency_floor(self, direction):
        """d int8 codes plus the fp16 scales, on both legs."""
        _check_direction(direction)
        return float(8 * self.d_model + self._n_scales() * torch.finfo(SCALE_DTYPE).bits)
