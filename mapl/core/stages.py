"""A model split into P pipeline stages with a compressor at every boundary.

``stage_forward(s, ...)`` is all stage s computes; the single-process pipeline (``forward``) chains the stages
through ``WireTransfer``, and the multi-process runtime runs the same ``stage_forward`` on a copy pruned to one
stage, so both compute the same numbers.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .compress import build_boundary, shared_basis
from .compress.anchors import Anchor
from .compress.base import WireTransfer
from .compress.ssn import constrain_to_subspace
from .config import RunConfig
from .model import ModelConfig, Transformer
from .seeds import derive_seed
from .wire import id_dtype

__all__ = ["split_layers", "StagedModel", "build_staged_model", "chunked_linear_cross_entropy"]


def _block_cost(cfg: ModelConfig) -> float:
    d, f, hd = cfg.d_model, cfg.ffn_hidden, cfg.head_dim
    return d * cfg.n_heads * hd * 2 + 2 * d * cfg.n_kv_heads * hd + 3 * d * f


def split_layers(cfg: ModelConfig, stages: int) -> list[list[int]]:
    """Contiguous layer ranges (at least one per stage) minimising the most loaded stage, in matmul parameters per
    token: a block its weights, the head d x V, the embedding 0."""
    L = cfg.n_layers
    if not 1 <= stages <= L:
        raise ValueError(f"stages={stages} is invalid: must be in [1, n_layers={L}]")
    block, head = _block_cost(cfg), cfg.d_model * cfg.vocab_size
    # best[s][i]: minimal max-load placing layers i.. into stages s..P-1 (small DP: L, P <= 64)
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(stages + 1)]
    cut = [[0] * (L + 1) for _ in range(stages + 1)]
    best[stages][L] = 0.0
    for s in range(stages - 1, -1, -1):
        for i in range(L):
            for j in range(i + 1, L - (stages - s - 1) + 1):
                load = (j - i) * block + (head if s == stages - 1 else 0)
                if s == stages - 1 and j != L:
                    continue
                cand = max(load, best[s + 1][j])
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    out, i = [], 0
    for s in range(stages):
        j = cut[s][i]
        out.append(list(range(i, j)))
        i = j
    return out


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk_tokens: int) -> torch.Tensor:
    """Mean fp32 cross-entropy of ``h @ weightᵀ``, ``chunk_tokens`` rows at a time, each chunk a checkpoint whose
    backward recomputes its logits: one chunk's V-wide tensors alive, not the micro-batch's (~4 GiB per
    16 x 2048 at V = 32k). Equal to the one-block loss up to summation order."""
    n = targets.numel()
    total = sum(checkpoint(_chunk_loss_sum, h[i:i + chunk_tokens], weight, targets[i:i + chunk_tokens],
                           use_reentrant=False, preserve_rng_state=False) for i in range(0, n, chunk_tokens))
    return total / n


class StagedModel(nn.Module):
    def __init__(self, model: Transformer, split: list[list[int]], anchors: list[Anchor],
                 boundaries: list[nn.Module], activation_checkpointing: bool = False, norm_cast: str = "per-linear"):
        super().__init__()
        self.model = model
        self.activation_checkpointing = activation_checkpointing      # per block (train.activation_checkpointing)
        for block in model.layers.values():                           # train.norm_cast (mapl.core.model.Block)
            block.cast_norm_once = norm_cast == "once"
        self.split = split
        self.n_stages = len(split)
        self.anchors = nn.ModuleDict({str(s): a for s, a in enumerate(anchors)})
        self.boundaries = nn.ModuleDict({str(p): b for p, b in enumerate(boundaries)})
        self.ids_on_wire = any(a.needs_token_ids for a in anchors[1:])
        self.id_dtype = id_dtype(model.cfg.vocab_size)

    # ---- one stage ------------------------------------------------------------------------
    def _residual(self, s: int, inp: torch.Tensor | None, ids: torch.Tensor):
        """Stage s up to its last block, (h, anchor). The stream stays fp32 under bf16 autocast: a bf16 stream
        carrying SSN's N(0, 1) shift loses the small signal beside it (messages off by 10-20%)."""
        m = self.model
        dt = m.layers[str(self.split[s][0])].attn_norm.weight.dtype
        h = (m.embed(ids) if s == 0 else self.boundaries[str(s - 1)].decode(inp)).to(dt)
        a = self.anchors[str(s)](ids)
        if a is not None:
            a = a.to(dt)
            h = h + a
        for i in self.split[s]:
            h = self._block(m.layers[str(i)], h)
        return h, a

    def _block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        cos, sin = self.model.rope_cos, self.model.rope_sin
        if self.activation_checkpointing and torch.is_grad_enabled():
            # keep only the block's input; recompute its inside in backward (same numbers, less memory)
            return checkpoint(block, h, cos, sin, use_reentrant=False)
        return block(h, cos, sin)

    def stage_forward(self, s: int, inp: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """Stage s: (embed | decode) -> +anchor -> blocks -> (head | -anchor -> encode)."""
        h, a = self._residual(s, inp, ids)
        if s == self.n_stages - 1:
            return self.model.head(h)
        return self.boundaries[str(s)].encode(h if a is None else h - a)

    def stage_loss(self, s: int, inp: torch.Tensor | None, ids: torch.Tensor, targets: torch.Tensor,
                   chunk_tokens: int = 0) -> torch.Tensor:
        """The last stage's mean cross-entropy, in one block or in chunks (``train.loss_chunk_tokens``)."""
        if not chunk_tokens or chunk_tokens >= targets.numel():
            out = self.stage_forward(s, inp, ids)
            return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))
        h, _ = self._residual(s, inp, ids)
        m = self.model
        hn = m.norm(h)
        return chunked_linear_cross_entropy(hn.reshape(-1, hn.shape[-1]), m.output.weight, targets.reshape(-1),
                                            chunk_tokens)

    def boundary_input(self, s: int, inp: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """What stage s's projector sees: its residual minus its anchor (diagnostics, tests)."""
        h, a = self._residual(s, inp, ids)
        return h if a is None else h - a

    # ---- the single-process pipeline ------------------------------------------------------
    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None, meter=None, loss_chunk_tokens: int = 0):
        """Every stage in order, each boundary through its wire: the mean loss, or logits without ``targets``."""
        x, last = None, self.n_stages - 1
        for s in range(last):
            comp = self.boundaries[str(s)]
            x = WireTransfer.apply(self.stage_forward(s, x, ids), comp, meter, s)
            if meter is not None and self.ids_on_wire:
                meter.add(s, "fwd", "ids", ids.numel() * self.id_dtype.itemsize)
        if targets is None:
            return self.stage_forward(last, x, ids)
        return self.stage_loss(last, x, ids, targets, loss_chunk_tokens)

    @torch.no_grad()
    def find_nonfinite(self, ids: torch.Tensor) -> str | None:
        """Off the hot path: the first stage output or boundary message holding NaN/Inf, or None."""
        x = None
        for s in range(self.n_stages):
            out = self.stage_forward(s, x, ids)
            if not torch.isfinite(out).all():
                return f"stage {s} output" + ("" if s == self.n_stages - 1 else f" (boundary {s}, before the wire)")
            if s < self.n_stages - 1:
                comp = self.boundaries[str(s)]
                x = comp.unpack(comp.pack(out), out.dtype)
                if not torch.isfinite(x).all():
                    return f"boundary {s} message after the wire"
        return None

    # ---- bookkeeping ----------------------------------------------------------------------
    def compressors(self):
        return [self.boundaries[str(p)] for p in range(self.n_stages - 1)]

    def id_bytes_per_token(self) -> int:
        return self.id_dtype.itemsize if self.ids_on_wire else 0

    def prune_to_stage(self, s: int) -> "StagedModel":
        """Drop everything stage s does not hold (in place). Boundary s-1 stays as the receiver's copy."""
        m = self.model
        for i in list(m.layers.keys()):
            if int(i) not in self.split[s]:
                del m.layers[i]
        if s > 0:
            m.tok_embeddings = None
        if s < self.n_stages - 1:
            m.norm, m.output = None, None
        for k in list(self.anchors.keys()):
            if int(k) != s:
                del self.anchors[k]
        for k in list(self.boundaries.keys()):
            if int(k) not in (s - 1, s):
                del self.boundaries[k]
        return self


def build_staged_model(cfg: RunConfig, vocab_size: int) -> StagedModel:
    """Deterministic in the seeds: every rank builds the same model."""
    mc = cfg.model_config(vocab_size)
    comp = cfg.compressor_for(mc.d_model)
    torch.manual_seed(cfg.train.seed)
    model = Transformer(mc)
    split = split_layers(mc, cfg.stages)
    r = comp.rank(mc.d_model)
    if comp.method == "ssn":
        sent_layers = [i for part in split[:-1] for i in part]
        constrain_to_subspace(model, shared_basis(comp, mc.d_model), sent_layers)
    ac = comp.anchor
    anchors = []
    for s in range(cfg.stages):
        # the static shift is one table shared by all stages (same seed); learned anchors differ per stage
        seed = derive_seed(comp.seed, "static_shift") if ac.kind == "static" else derive_seed(comp.seed, "anchor", s)
        anchors.append(Anchor(ac.kind, mc.vocab_size, mc.d_model, ac.rank or r, seed=seed,
                              static_std=ac.static_std, init_std=ac.init_std))
    boundaries = [build_boundary(comp, mc.d_model, p) for p in range(cfg.stages - 1)]
    # 'auto' is resolved to on/off by the engine from the memory plan (mapl.core.memory.resolve_checkpointing)
    return StagedModel(model, split, anchors, boundaries, cfg.train.activation_checkpointing == "on",
                       cfg.train.norm_cast)
