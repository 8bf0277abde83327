"""Bit-exact packing of small non-negative integers (codebook indices) into bytes.

The indices form one little-endian bit stream (value i occupies bits [i*bits, (i+1)*bits), LSB first), cut
into bytes: the little-endian bytes of sum(v_i << (i*bits)). ``bits=8`` is uint8, ``bits=16`` little-endian
uint16, and only the final byte is padded, so ``count`` values take exactly ceil(count*bits/8) bytes.
"""
from __future__ import annotations

import math

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_bits_rows", "unpack_bits_rows"]

MAX_BITS = 16


def packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits!r} is invalid; allowed: an int in 1..{MAX_BITS}")


def pack_bits(indices: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Integer ``indices`` (any shape, C order), each in [0, 2**bits), as a 1-D uint8 tensor. ``check=False``
    skips the range check (a host sync on a GPU) for values in range by construction."""
    _check_bits(bits)
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.is_complex():
        raise ValueError(f"pack_bits needs an integer tensor, got dtype {indices.dtype}")
    v = indices.reshape(-1).to(torch.int64)
    n = v.numel()
    nbytes = packed_nbytes(n, bits)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=v.device)
    if check and (int(v.min()) < 0 or int(v.max()) >= (1 << bits)):
        lo, hi = int(v.min()), int(v.max())
        raise ValueError(f"indices out of range for bits={bits}: min {lo}, max {hi}, allowed [0, {1 << bits})")
    if bits == 8:                    # the default codebook (K = 256): one byte a value
        return v.to(torch.uint8)
    # an (n, bits) bit matrix, one column per bit position, read as one stream cut into bytes
    bm = torch.empty(n, bits, dtype=torch.uint8, device=v.device)
    for b in range(bits):
        bm[:, b] = (v >> b) & 1
    stream = bm.reshape(-1)
    pad = nbytes * 8 - stream.numel()
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    stream = stream.view(nbytes, 8)
    out = stream[:, 0].clone()
    for j in range(1, 8):
        out |= stream[:, j] << j
    return out


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` values, int64; extra bytes are ignored."""
    _check_bits(bits)
    if data.dtype != torch.uint8:
        raise ValueError(f"unpack_bits needs a uint8 tensor, got dtype {data.dtype}")
    nbytes = packed_nbytes(count, bits)
    data = data.reshape(-1)
    if data.numel() < nbytes:
        raise ValueError(f"{count} values at {bits} bits need {nbytes} bytes, got {data.numel()}")
    data = data[:nbytes]
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if bits == 8:
        return data.to(torch.int64)
    bm = torch.empty(nbytes, 8, dtype=torch.uint8, device=data.device)
    for j in range(8):
        bm[:, j] = (data >> j) & 1
    bm = bm.reshape(-1)[: count * bits].view(count, bits).to(torch.int64)
    out = bm[:, 0].clone()
    for b in range(1, bits):
        out |= bm[:, b] << b
    return out


def _row_pad(m: int, bits: int) -> int:
    """Smallest m' >= m with m'*bits a multiple of 8."""
    g = 8 // math.gcd(bits, 8)
    return -(-m // g) * g


def pack_bits_rows(indices: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Each row of a (B, m) tensor packed on its own, (B, ceil(m*bits/8)) uint8: row b is pack_bits(indices[b])."""
    if indices.dim() != 2:
        raise ValueError(f"pack_bits_rows needs a 2-D tensor, got shape {tuple(indices.shape)}")
    B, m = indices.shape
    mp = _row_pad(m, bits)
    v = indices.to(torch.int64)
    if mp != m:
        v = torch.cat([v, v.new_zeros(B, mp - m)], dim=1)
    out = pack_bits(v, bits, check=check).view(B, mp * bits // 8)
    return out[:, : packed_nbytes(m, bits)].contiguous()


def unpack_bits_rows(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits_rows`: ``(B, nbytes)`` uint8 -> ``(B, count)`` int64."""
    if data.dim() != 2:
        raise ValueError(f"unpack_bits_rows needs a 2-D tensor, got shape {tuple(data.shape)}")
    B, nb = data.shape
    need = packed_nbytes(count, bits)
    if nb < need:
        raise ValueError(f"{count} values at {bits} bits need {need} bytes per row, got {nb}")
    mp = _row_pad(count, bits)
    row = mp * bits // 8
    d = data[:, :need]
    if row != need:
        d = torch.cat([d, d.new_zeros(B, row - need)], dim=1)
    return unpack_bits(d.reshape(-1), bits, B * mp).view(B, mp)[:, :count]
