"""Grouped residual VQ with EMA k-means codebooks: search, lookup, learning, dead-code revival.

Z (width ``dim``) is cut into ``groups`` sub-vectors of ds = dim / groups; each is quantised by ``rounds`` rounds
of greedy residual search with K codewords per round: G*R*log2(K) bits a token. The codebooks learn by EMA
k-means on the sender (the SoundStream / VQ-VAE-2 rule; no gradient, no auxiliary loss); the model trains
through the quantiser by the straight-through estimator (``WireTransfer``).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .native import native_available, native_search
from .search import SEARCH_KERNELS, first_argmin_, fused_allowed, residual_search, search_tiles, tile_budget

__all__ = ["ResidualVQ", "OP_NONE", "OP_EMA", "OP_INIT", "codebook_bits", "to_device_async", "bincount", "DeviceFlag"]

# What a forward message says happened to the sender's codebooks (header field 1).
OP_NONE, OP_EMA, OP_INIT = 0, 1, 2


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU-made tensor on ``device`` without a host sync (through pinned memory): CPU draws stay the same
    numbers on every device."""
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class DeviceFlag:
    """A flag raised by device-side comparisons, read on the host only when asked (no host sync per message)."""

    def __init__(self, value: bool = False):
        self._host, self._device = bool(value), None

    def raise_if(self, condition: torch.Tensor) -> None:
        self._device = condition if self._device is None else self._device | condition

    def read(self) -> bool:
        if self._device is not None:
            self._host |= bool(self._device)
            self._device = None
        return self._host


def bincount(flat: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(flat, minlength=n)`` for values in 0..n-1, without CUDA bincount's host read."""
    return torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def codebook_bits(k) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 2 or k & (k - 1) or k > 65536:
        raise ValueError(f"codebook_size={k!r} is invalid; allowed: a power of two in 2..65536")
    return k.bit_length() - 1


class ResidualVQ(nn.Module):
    """Buffers: ``codebooks`` (G,R,K,ds), EMA state ``cluster_size`` (G,R,K) and ``embed_sum``, ``initted``,
    ``version`` (+1 per change). :meth:`search` and :meth:`lookup` are pure; :meth:`update` (the sender) and
    :meth:`mirror` (a receiver) learn. Randomness comes from a CPU generator seeded with ``seed``; nothing is
    read back to the host per message (host mirrors of ``version`` and ``initted``, fixed-shape revivals).
    """

    def __init__(self, *, dim: int, groups: int | None = None, rounds: int = 2, codebook_size: int = 256,
                 decay: float = 0.99, eps: float = 1e-5, kmeans_init: bool = True, kmeans_iters: int = 10,
                 dead_code_threshold: float = 1.0, seed: int = 0, max_revive: int | None = None,
                 tile_bytes: int = 0, search_kernel: str = "auto"):
        super().__init__()
        groups = max(1, dim // 2) if groups is None else groups      # default: 2-dim codewords
        _check_shape(dim, groups, rounds)
        self.bits = codebook_bits(codebook_size)
        max_revive = codebook_size if max_revive is None else max_revive
        if search_kernel not in SEARCH_KERNELS:
            raise ValueError(f"search_kernel={search_kernel!r} is invalid; allowed: {', '.join(map(repr, SEARCH_KERNELS))}")
        self.dim, self.groups, self.rounds, self.codebook_size = dim, groups, rounds, codebook_size
        self.sub_dim = dim // groups
        self.decay, self.eps = float(decay), float(eps)
        self.kmeans_init, self.kmeans_iters = bool(kmeans_init), int(kmeans_iters)
        self.dead_code_threshold = float(dead_code_threshold)
        self.max_revive = int(max_revive)
        self.tile_bytes = tile_bytes
        self.search_kernel = search_kernel
        self.seed = seed
        # a revived code's EMA count: ~log(2)/(1-decay) updates of grace before it can be revived again
        self.revive_count = 2.0 * self.dead_code_threshold if self.dead_code_threshold > 0 else 1.0
        G, R, K, ds = groups, rounds, codebook_size, self.sub_dim
        self._gen = torch.Generator().manual_seed(seed)
        # data-independent start (used as-is without k-means init); later rounds start smaller
        cb = torch.randn(G, R, K, ds, generator=self._gen, device="cpu")
        cb = cb * (0.5 ** torch.arange(R, dtype=torch.float32, device="cpu")).view(1, R, 1, 1)
        self.register_buffer("codebooks", cb)
        self.register_buffer("cluster_size", torch.ones(G, R, K, device="cpu"))   # prior: one observation per code
        self.register_buffer("embed_sum", cb.clone())
        self.register_buffer("initted", torch.tensor(not self.kmeans_init, device="cpu"))
        self.register_buffer("version", torch.zeros((), dtype=torch.int64, device="cpu"))
        self._host = {"version": 0, "initted": not self.kmeans_init}    # mirrors of the two buffers

    @property
    def bits_per_token(self) -> int:
        return self.groups * self.rounds * self.bits

    # ---- checkpointing of the RNG ---------------------------------------------------------
    def get_extra_state(self):
        return {"gen": self._gen.get_state()}

    def set_extra_state(self, state) -> None:
        # called by load_state_dict after the buffers: the one host read of version and initted
        self._gen.set_state(state["gen"])
        self._host = {"version": int(self.version), "initted": bool(self.initted)}

    # ---- host-side mirrors (no host read per message) ---------------------------------------
    @property
    def host_version(self) -> int:
        return self._host["version"]

    @property
    def host_initted(self) -> bool:
        return self._host["initted"]

    def _bump_version(self) -> None:
        self.version += 1
        self._host["version"] += 1

    def mark_initted(self) -> None:
        self.initted.fill_(True)
        self._host["initted"] = True

    # ---- pure ------------------------------------------------------------------------------
    @torch.no_grad()
    def search(self, z: torch.Tensor, *, codebooks: torch.Tensor | None = None, return_residual: bool = False,
               return_stats: bool = False):
        """``z (..., dim) -> idx (..., G, R)`` int64 (and the final residual with ``return_residual``), searching
        ``codebooks`` (default: these) in float64 if either is float64, else float32. ``return_stats`` adds, where
        the CPU's fused kernel ran (else None), what :meth:`update` needs from the search: (round targets, sums,
        counts), the bits :meth:`update` would compute itself."""
        if z.shape[-1] != self.dim:
            raise ValueError(f"search expects last dim {self.dim}, got shape {tuple(z.shape)}")
        lead = z.shape[:-1]
        cb = self.codebooks if codebooks is None else codebooks
        dt = torch.float64 if torch.float64 in (z.dtype, cb.dtype) else torch.float32
        x = z.detach().reshape(-1, self.groups, self.sub_dim).to(dt)
        C = cb.to(dt)
        stats = None
        if self.search_kernel == "auto" and fused_allowed() and native_available(x, C):
            learn = return_stats and dt == self.codebooks.dtype
            idx, resid, stats = native_search(x, C, return_residual=return_residual, return_stats=learn)
        else:
            idx, resid = residual_search(x, C, kernel=self.search_kernel, tile_bytes=self.tile_bytes,
                                         return_residual=return_residual)
        idx = idx.view(*lead, self.groups, self.rounds)
        out = (idx, resid.view(*lead, self.dim)) if return_residual else (idx,)
        return (*out, stats) if return_stats else (out if return_residual else idx)

    def lookup(self, idx: torch.Tensor, codebooks: torch.Tensor | None = None) -> torch.Tensor:
        """``idx (..., G, R) -> (..., dim)``: the rounds' codewords summed, groups concatenated."""
        cb = self.codebooks if codebooks is None else codebooks
        G, R = self.groups, self.rounds
        if idx.shape[-2:] != (G, R):
            raise ValueError(f"lookup expects idx (..., {G}, {R}), got shape {tuple(idx.shape)}")
        lead = idx.shape[:-2]
        K, ds = cb.shape[-2], cb.shape[-1]
        # one row gather from the flat (G*R*K, ds) table (2.5x faster than per-round fancy indexing)
        flat = (idx.reshape(-1, G, R).long() + self._row_offsets(idx.device)).reshape(-1)
        sel = cb.reshape(G * R * K, ds).index_select(0, flat).view(-1, G, R, ds)
        out = sel[:, :, 0]                                              # (N, G, ds)
        for r in range(1, R):                                           # rounds summed in order
            out = out + sel[:, :, r]
        return out.reshape(*lead, self.dim)

    def _row_offsets(self, device) -> torch.Tensor:
        G, R, K = self.groups, self.rounds, self.codebook_size
        return (torch.arange(G, device=device)[:, None] * R + torch.arange(R, device=device)) * K

    def code_counts(self, idx: torch.Tensor) -> torch.Tensor:
        G, R, K = self.groups, self.rounds, self.codebook_size
        i = idx.reshape(-1, G, R).long()
        counts = bincount((i + self._row_offsets(i.device)).reshape(-1), G * R * K)
        return counts.view(G, R, K).to(self.codebooks.dtype)

    def _targets(self, x: torch.Tensor, idx: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        """The residuals the search with ``cb`` quantised in each round: x (N,G,ds) -> (N,G,R,ds)."""
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, x.shape[-1]
        out = torch.empty(*x.shape[:2], R, ds, dtype=x.dtype, device=x.device)
        flat_cb = cb.reshape(G * R * K, ds)
        flat = (idx + self._row_offsets(x.device))                     # (N, G, R)
        res = x.clone()
        for r in range(R):
            out[:, :, r] = res
            if r + 1 < R:
                res -= flat_cb.index_select(0, flat[:, :, r].reshape(-1)).view(res.shape).to(x.dtype)
        return out

    def _assign(self, x: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        G, K = C.shape[0], C.shape[1]
        c2 = (C * C).sum(-1).unsqueeze(1)
        Ct = C.transpose(1, 2).contiguous()
        rev = torch.arange(K, 0, -1, device=x.device, dtype=x.dtype)
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.int64, device=x.device)
        gs, ts = search_tiles(G, x.shape[1], K, tile_budget(self.tile_bytes, x.dtype, x.device))
        for g0 in range(0, G, gs):
            for s in range(0, x.shape[1], ts):
                d = torch.baddbmm(c2[g0:g0 + gs], x[g0:g0 + gs, s:s + ts], Ct[g0:g0 + gs], alpha=-2.0)
                out[g0:g0 + gs, s:s + ts] = first_argmin_(d, rev)
        return out

    def _kmeans(self, x: torch.Tensor) -> torch.Tensor:
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, self.sub_dim
        N = x.shape[0]
        res = x.transpose(0, 1).contiguous()                          # (G, N, ds)
        gi = torch.arange(G, device=x.device)[:, None]
        offs = torch.arange(G, device=x.device)[:, None] * K
        out = torch.empty(G, R, K, ds, dtype=x.dtype, device=x.device)
        for r in range(R):
            sel = to_device_async(torch.randperm(N, generator=self._gen, device="cpu")[:K] if N >= K
                                  else torch.randint(N, (K,), generator=self._gen, device="cpu"), x.device)
            C = res[:, sel].clone()
            for _ in range(self.kmeans_iters):
                flat = (self._assign(res, C) + offs).reshape(-1)
                counts = bincount(flat, G * K).view(G, K, 1)
                sums = torch.zeros(G * K, ds, dtype=x.dtype, device=x.device).index_add_(0, flat, res.reshape(-1, ds))
                C = torch.where(counts > 0, sums.view(G, K, ds) / counts.clamp(min=1).to(x.dtype), C)
            res -= C[gi, self._assign(res, C)]
            out[:, r] = C
        return out

    # ---- stateful (sender learning / receiver mirroring) ----------------------------------
    @torch.no_grad()
    def _apply_init(self, cb: torch.Tensor, n_tokens: int) -> None:
        c0 = max(n_tokens / self.codebook_size, self.revive_count)   # uniform EMA prior
        self.codebooks.copy_(cb)
        self.cluster_size.fill_(c0)
        self.embed_sum.copy_(self.codebooks * c0)
        self.mark_initted()

    @torch.no_grad()
    def _apply_ema(self, counts: torch.Tensor, sums: torch.Tensor) -> None:
        d = self.decay
        self.cluster_size.mul_(d).add_(counts, alpha=1.0 - d)
        self.embed_sum.mul_(d).add_(sums, alpha=1.0 - d)
        n = self.cluster_size.sum(-1, keepdim=True)
        smoothed = (self.cluster_size + self.eps) / (n + self.codebook_size * self.eps) * n   # Laplace
        self.codebooks.copy_(self.embed_sum / smoothed.unsqueeze(-1))

    @torch.no_grad()
    def _apply_revivals(self, rpos: torch.Tensor, rval: torch.Tensor) -> None:
        """Replace codes ``rpos`` (G,R,M; -1 unused) by ``rval`` and reset their EMA state, without a host read:
        slots scatter into a (K+1)-wide scratch whose last column takes the unused ones."""
        cb = self.codebooks
        G, R, K, ds = cb.shape
        k = torch.where(rpos >= 0, rpos.long(), K)
        hit = torch.zeros(G, R, K + 1, dtype=torch.bool, device=cb.device).scatter_(2, k, True)[..., :K]
        v = torch.zeros(G, R, K + 1, ds, dtype=cb.dtype, device=cb.device).scatter_(
            2, k.unsqueeze(-1).expand(*k.shape, ds), rval.to(cb.dtype))[..., :K, :]
        h = hit.unsqueeze(-1)
        cb.copy_(torch.where(h, v, cb))
        self.cluster_size.copy_(torch.where(hit, self.revive_count, self.cluster_size))
        self.embed_sum.copy_(torch.where(h, v * self.revive_count, self.embed_sum))

    def no_revivals(self) -> tuple[torch.Tensor, torch.Tensor]:
        G, R, M, ds, cb = self.groups, self.rounds, self.max_revive, self.sub_dim, self.codebooks
        return (torch.full((G, R, M), -1, dtype=torch.int32, device=cb.device),
                torch.zeros(G, R, M, ds, dtype=cb.dtype, device=cb.device))

    def _pick_revivals(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dead codes (EMA count < threshold), at most ``max_revive`` per codebook, lowest first, each paired with
        a random token's residual: positions (G,R,M) int32 (-1 none) and values (G,R,M,ds)."""
        G, R, K = self.groups, self.rounds, self.codebook_size
        M, dev = self.max_revive, self.codebooks.device
        N = targets.shape[0]
        tok = to_device_async(torch.randint(N, (G, R, max(M, 1)), generator=self._gen, device="cpu"), dev)[..., :M]
        if M == 0 or self.dead_code_threshold <= 0:
            return self.no_revivals()
        cs = self.cluster_size
        key = torch.where(cs < self.dead_code_threshold, cs, torch.full_like(cs, math.inf))
        if M >= K:
            pos = torch.arange(K, device=dev).expand(G, R, K)
            ok = torch.isfinite(key)
        else:
            vals, pos = key.topk(M, dim=-1, largest=False, sorted=True)
            ok = torch.isfinite(vals)
        # a residual for every slot (fixed shape: no host read of how many are dead), 0 where none is due
        g, r = torch.arange(G, device=dev)[:, None, None], torch.arange(R, device=dev)[None, :, None]
        ds = targets.shape[-1]                   # targets[tok, g, r] as one row gather (advanced indexing is slower)
        picked = targets.reshape(-1, ds).index_select(0, ((tok * G + g) * R + r).reshape(-1)).view(G, R, M, ds)
        rval = torch.where(ok.unsqueeze(-1), picked.to(self.codebooks.dtype), 0.0)
        rpos = torch.where(ok, pos, torch.full_like(pos, -1)).to(torch.int32)
        return rpos, rval

    @torch.no_grad()
    def update(self, z: torch.Tensor, idx: torch.Tensor, *, codebooks: torch.Tensor | None = None,
               stats: tuple | None = None) -> dict:
        """One learning step from ``z`` and its indices, searched with ``codebooks`` (default: these). Before the
        init: residual k-means on this batch (OP_INIT, ``stat`` the codebooks); else EMA of counts and sums,
        Laplace-smoothed codebooks, dead-code revival (OP_EMA, ``stat`` the sums). ``stats``: the search's
        (targets, sums, counts) of the same ``z`` and ``codebooks`` (``search(return_stats=True)``), used instead of
        computing them again. Returns the op record."""
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, self.sub_dim
        x = z.detach().reshape(-1, G, ds).to(self.codebooks.dtype)
        i = idx.reshape(-1, G, R).long()
        N = x.shape[0]
        dev = self.codebooks.device
        if not self.host_initted:
            cb = self._kmeans(x)
            self._apply_init(cb, N)
            self._bump_version()
            rpos, rval = self.no_revivals()
            return {"op": OP_INIT, "stat": cb, "n_tokens": N, "rpos": rpos, "rval": rval}
        if stats is not None:                                  # the fused search's: the same bits
            targets, sums, counts = stats
            counts = counts.to(self.codebooks.dtype)
        else:
            targets = self._targets(x, i, self.codebooks if codebooks is None else codebooks)
            flat = (i + self._row_offsets(dev)).reshape(-1)
            sums = torch.zeros(G * R * K, ds, dtype=x.dtype, device=dev).index_add_(0, flat, targets.reshape(-1, ds))
            sums = sums.view(G, R, K, ds)
            counts = bincount(flat, G * R * K).view(G, R, K).to(self.codebooks.dtype)   # = code_counts(i)
        self._apply_ema(counts, sums)
        rpos, rval = self._pick_revivals(targets)
        self._apply_revivals(rpos, rval)
        self._bump_version()
        return {"op": OP_EMA, "stat": sums, "rpos": rpos, "rval": rval, "n_tokens": N, "counts": counts}

    @torch.no_grad()
    def mirror(self, op: int, stat: torch.Tensor, rpos: torch.Tensor, rval: torch.Tensor, idx: torch.Tensor) -> None:
        """Repeat a sender's :meth:`update` from its op record and the message's indices, bit-identically."""
        if op == OP_NONE:
            return
        i = idx.reshape(-1, self.groups, self.rounds)
        if op == OP_INIT:
            self._apply_init(stat, i.shape[0])
        elif op == OP_EMA:
            self._apply_ema(self.code_counts(i), stat.to(self.codebooks.dtype))
            self._apply_revivals(rpos, rval)
        else:
            raise ValueError(f"unknown op {op}")
        self._bump_version()


def _check_shape(dim, groups, rounds) -> None:
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim={dim!r} is invalid; allowed: a positive int")
    if not isinstance(groups, int) or groups < 1 or dim % groups:
        raise ValueError(f"dim={dim} is not divisible by groups={groups}; groups must divide dim")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid; allowed: an int >= 1")
