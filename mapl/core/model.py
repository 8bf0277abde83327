"""LLaMA-style decoder: RMSNorm, RoPE, SwiGLU, optional grouped-query attention; no distribution code.

Layers live in an ``nn.ModuleDict`` keyed by ``str(i)`` so a pipeline stage can drop the layers it does not own
and keep checkpoint names; ``forward`` tolerates a missing embedding or head.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model_config import PRESETS, ModelConfig, count_params

__all__ = ["ModelConfig", "PRESETS", "RMSNorm", "Attention", "FeedForward", "Block", "Transformer",
           "rope_tables", "count_params"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim // 2), float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x, cos, sin):
    """Rotate the two halves of x (B, H, T, hd) (LLaMA's "rotate_half") in fp32, each written straight into an
    output of x's dtype: no fp32 copy of the whole rotated q or k under bf16 autocast (as torch.cat would)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = x.new_empty(x.shape)                  # contiguous, as torch.cat's output: SDPA sees the same layout
    half = x.shape[-1] // 2
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x1 * sin + x2 * cos
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.d_model, bias=False)   # writes the residual stream

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)   # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)   # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)   # down: writes the residual stream

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _cast_once(h: torch.Tensor) -> torch.Tensor:
    dev = h.device.type
    return h.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else h


class Block(nn.Module):
    """Pre-norm block (SSN needs it: the stream is then the embedding plus the wo/w2 outputs).
    ``cast_norm_once`` (``train.norm_cast: once``): the linears reading a norm share one bf16 copy of its
    output, not one each (2 copies per block instead of 5); off by default, as the committed runs were."""
    cast_norm_once = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin):
        if self.cast_norm_once:
            x = x + self.attn(_cast_once(self.attn_norm(x)), cos, sin)
            return x + self.ffn(_cast_once(self.ffn_norm(x)))
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim == 1 or p.is_meta:
                continue                                   # norm gains stay 1; a meta model has no values to draw
            nn.init.normal_(p, 0.0, std)
            if name.endswith(("attn.wo.weight", "ffn.w2.weight")):
                # GPT-2 scaling: residual writers shrink with depth so the stream's variance stays O(1)
                p.data.div_(math.sqrt(2 * self.cfg.n_layers))

    # The three pieces a stage may own; each is optional so a stage can drop what it does not hold.
    def embed(self, tokens):
        return self.tok_embeddings(tokens)

    def run_layers(self, h):
        T = h.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return h

    def head(self, h):
        return self.output(self.norm(h))

    def forward(self, tokens):
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens
        h = self.run_layers(h)
        return self.head(h) if self.output is not None else h
