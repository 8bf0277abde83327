"""Residual vector quantisation of the projected activation Z ("MAPL+VQ", paper §1.5).

Two pieces:

* :class:`ResidualVQ` -- grouped residual VQ with EMA k-means codebooks. Z (width ``dim``) is cut
  into ``groups`` contiguous sub-vectors of ``dim/groups`` dims; each group is quantised by ``rounds``
  rounds of greedy residual search, each round with its own codebook of ``codebook_size`` (K)
  codewords. Codebooks: buffer ``(G, R, K, dim/G)``. One token costs ``G*R*log2(K)`` bits.
* :class:`RVQCompressor` -- the boundary compressor (method ``mapl-rvq``): the inner projection
  (``encode``/``decode``) followed, on the wire only, by RVQ of z. The sender owns the learned
  codebooks; the receiver decodes with its *own* copy, kept in step by a sync stream piggybacked on
  the forward payload and metered as overhead.

Defaults: K=256, G=r/2 groups (2-dim codewords), R=2 rounds -> G*R*8 = 8r bits = r bytes/token, half
of MAPL's bf16 z (2r bytes/token). Among the 8-bit/dim layouts with K=256 (codeword dims ds = rounds
R = 1, 2, 4, 8; same search cost) on synthetic r=64 data after EMA training, 2x2 was the robust
choice: scalar (1x1) was 8-15% better on Gaussian data but 2x worse on heavy-tailed (Student-t)
data; 4x4 was 15-55% worse on Gaussian-like data and similar on heavy tails; 8x8 was worst. Its
codebooks (and the sync stream) are also half the size of the 4x4 layout's. Higher ratios: R=1 ->
4 bits/dim (4x over bf16); 4-dim codewords (G=r/4) with R=1 -> 2 bits/dim (8x over bf16, i.e. 32x
overall at a 4x projection); or fewer groups. Search cost is proportional to ``tokens * G * R * K * dim/G = tokens
* r * R * K``.

Learning rule (the paper leaves it open [UNKNOWN]; we use the SoundStream/VQ-VAE-2 rule): EMA k-means
on the sender, no gradient to the codebooks, no auxiliary loss; the model trains through the
quantiser with the straight-through estimator (``WireTransfer``: forward z -> unpack(pack(z)),
backward gradient passed to z unchanged after its own wire trip).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .base import Compressor, _check_direction, tensor_checksum
from .bitpack import pack_bits_rows, packed_nbytes, unpack_bits_rows

__all__ = ["ResidualVQ", "RVQCompressor", "OP_NONE", "OP_EMA", "OP_INIT"]

# What a forward message says happened to the sender's codebooks (header field 1).
OP_NONE, OP_EMA, OP_INIT = 0, 1, 2

_DEFAULT_CHUNK_ELEMS = 1 << 20   # distance-matrix elements per search chunk (4 MiB at float32)


def _pow2_bits(k) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 2 or k & (k - 1) or k > 65536:
        raise ValueError(f"codebook_size={k!r} is invalid; allowed: a power of two in 2..65536")
    return k.bit_length() - 1


def _first_argmin_(d: torch.Tensor, rev: torch.Tensor) -> torch.Tensor:
    """``d.argmin(-1)`` (the first minimum on ties), overwriting ``d``; ``rev = arange(K, 0, -1)`` in d's dtype.

    ATen's CPU argmin is a scalar loop (~0.8 ns per value); this is four vectorised passes (~0.25 ns per
    value on a cache-sized block): m = min over the row; d <- (d <= m) * (K - k), i.e. K - k exactly at
    the minima and 0 elsewhere (an in-place float comparison, no bool tensor); the first minimum has the
    largest K - k. Exact: the comparison is against the row's own minimum, and K <= 2**16 is exact in
    float32. A row holding NaN yields an index in range (not necessarily argmin's).
    """
    K = d.shape[-1]
    m = d.amin(-1, keepdim=True)
    d.le_(m).mul_(rev)
    return (K - d.amax(-1).to(torch.int64)).clamp_(0, K - 1)


class ResidualVQ(nn.Module):
    """Grouped residual VQ with EMA k-means codebooks, k-means init and dead-code revival.

    Stateful methods (:meth:`update`, :meth:`set_codebooks`, the ``_apply_*`` helpers) are only ever
    called by the owner (``RVQCompressor.pack`` in training mode and not ``dry_run``, or the
    receiver's mirror); :meth:`search` and :meth:`lookup` are pure.

    Buffers: ``codebooks (G,R,K,ds)``; EMA state ``cluster_size (G,R,K)`` and ``embed_sum (G,R,K,ds)``;
    ``initted`` (k-means init done); ``version`` (+1 per change of the codebooks).
    All randomness (k-means seeding, revival samples) comes from a generator seeded with ``seed``.
    """

    def __init__(self, *, dim: int, groups: int | None = None, rounds: int = 2, codebook_size: int = 256,
                 decay: float = 0.99, eps: float = 1e-5, kmeans_init: bool = True, kmeans_iters: int = 10,
                 dead_code_threshold: float = 1.0, seed: int = 0, max_revive: int | None = None,
                 chunk_elems: int = _DEFAULT_CHUNK_ELEMS):
        super().__init__()
        if groups is None:                   # default: 2-dim codewords
            groups = max(1, dim // 2)
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim={dim!r} is invalid; allowed: a positive int")
        if not isinstance(groups, int) or groups < 1 or dim % groups:
            raise ValueError(f"dim={dim} is not divisible by groups={groups}; groups must divide dim")
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds={rounds!r} is invalid; allowed: an int >= 1")
        self.bits = _pow2_bits(codebook_size)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay!r} is invalid; allowed: 0 <= decay < 1")
        if max_revive is None:
            max_revive = codebook_size
        if not 0 <= max_revive <= codebook_size:
            raise ValueError(f"max_revive={max_revive!r} is invalid; allowed: 0..codebook_size")
        self.dim, self.groups, self.rounds, self.codebook_size = dim, groups, rounds, codebook_size
        self.sub_dim = dim // groups
        self.decay, self.eps = float(decay), float(eps)
        self.kmeans_init, self.kmeans_iters = bool(kmeans_init), int(kmeans_iters)
        self.dead_code_threshold = float(dead_code_threshold)
        self.max_revive = int(max_revive)
        self.chunk_elems = int(chunk_elems)
        self.seed = seed
        # EMA count a revived code restarts with: a grace period of ~log(2)/(1-decay) updates before
        # it can be revived again if it stays unused.
        self.revive_count = 2.0 * self.dead_code_threshold if self.dead_code_threshold > 0 else 1.0
        G, R, K, ds = groups, rounds, codebook_size, self.sub_dim
        self._gen = torch.Generator().manual_seed(seed)
        # data-independent start (used as-is without k-means init); later rounds start smaller
        cb = torch.randn(G, R, K, ds, generator=self._gen) * (0.5 ** torch.arange(R, dtype=torch.float32)).view(1, R, 1, 1)
        self.register_buffer("codebooks", cb)
        self.register_buffer("cluster_size", torch.ones(G, R, K))     # prior: one observation per code
        self.register_buffer("embed_sum", cb.clone())
        self.register_buffer("initted", torch.tensor(not self.kmeans_init))
        self.register_buffer("version", torch.zeros((), dtype=torch.int64))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, groups={self.groups}, rounds={self.rounds}, codebook_size={self.codebook_size}, "
                f"bits_per_token={self.bits_per_token}")

    @property
    def bits_per_token(self) -> int:
        return self.groups * self.rounds * self.bits

    # ---- checkpointing of the RNG ---------------------------------------------------------
    def get_extra_state(self):
        return {"gen": self._gen.get_state()}

    def set_extra_state(self, state) -> None:
        self._gen.set_state(state["gen"])

    # ---- pure ------------------------------------------------------------------------------
    def _chunk(self) -> int:
        return max(1, self.chunk_elems // (self.groups * self.codebook_size))

    def _tiles(self, n_groups: int, n_tokens: int) -> tuple[int, int]:
        """(groups, tokens) per search tile so a tile's (groups, tokens, K) distance block holds about
        ``chunk_elems`` values (cache-sized). All groups at once while that leaves >= 16 tokens per tile
        (few, large batched matmuls); for large K, fewer groups per tile rather than fewer tokens."""
        K, E = self.codebook_size, self.chunk_elems
        ts = E // (n_groups * K)
        if ts >= min(16, n_tokens):
            return n_groups, max(1, ts)
        gs = max(1, min(n_groups, E // (16 * K)))
        return gs, max(1, E // (gs * K))

    @torch.no_grad()
    def search(self, z: torch.Tensor, *, codebooks: torch.Tensor | None = None, return_residual: bool = False):
        """Greedy residual nearest-codeword search: ``z (..., dim) -> idx (..., G, R)`` (int64).

        Round r quantises the residual left by rounds < r with codebook r. Distances are
        ``||x||^2 - 2 x.c + ||c||^2`` via batched matmul; ``||x||^2`` is the same for every codeword, so
        the argmin is taken over ``||c||^2 - 2 x.c`` (ties: the first minimum, as ``argmin``). The work is
        tiled over (groups, tokens) so each (groups, tokens, K) distance block stays ~``chunk_elems``
        values and lives in cache; Python loops run over tiles and rounds only. Computed in float64
        if z or the codebooks are float64, else float32. ``codebooks`` (default: this module's) selects
        the codebooks searched. With ``return_residual`` also returns the final residual
        ``z - lookup(idx)`` (as computed by the search), shape (..., dim).
        """
        if z.shape[-1] != self.dim:
            raise ValueError(f"search expects last dim {self.dim}, got shape {tuple(z.shape)}")
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, self.sub_dim
        lead = z.shape[:-1]
        cb = self.codebooks if codebooks is None else codebooks
        dt = torch.float64 if torch.float64 in (z.dtype, cb.dtype) else torch.float32
        dev = z.device
        x = z.detach().reshape(-1, G, ds).to(dt).transpose(0, 1)     # (G, N, ds) view
        N = x.shape[1]
        C = cb.to(dt)                                                   # (G, R, K, ds)
        Cr = [C[:, r].contiguous() for r in range(R)]                   # (G, K, ds) per round
        # augmented codebooks [-2 c ; ||c||^2] (G, ds+1, K): with res_aug = [res, 1] one bmm gives
        # ||c||^2 - 2 res.c directly (no broadcast copy of ||c||^2 into the output, as baddbmm does)
        Ca = [torch.cat([-2.0 * c.transpose(1, 2), (c * c).sum(-1).unsqueeze(1)], 1).contiguous() for c in Cr]
        rev = torch.arange(K, 0, -1, device=dev, dtype=dt)             # K - k
        # outputs written straight into token-major (N, G, R) / (N, G, ds): contiguous for every consumer
        idx = torch.empty(N, G, R, dtype=torch.int64, device=dev)
        resid = torch.empty(N, G, ds, dtype=dt, device=dev) if return_residual else None
        gs, ts = self._tiles(G, N)
        for g0 in range(0, G, gs):
            g1 = min(G, g0 + gs)
            goff = torch.arange(g0, g1, device=dev)[:, None] * K        # row offsets into (G*K, ds)
            for s in range(0, N, ts):
                n = min(ts, N - s)
                res_aug = torch.ones(g1 - g0, n, ds + 1, dtype=dt, device=dev)
                res_aug[..., :ds] = x[g0:g1, s:s + n]
                res = res_aug[..., :ds]                                 # (gs, n, ds) view, updated in place
                for r in range(R):
                    d = torch.bmm(res_aug, Ca[r][g0:g1])                # (gs, n, K)
                    i = _first_argmin_(d, rev)
                    idx[s:s + n, g0:g1, r] = i.T
                    res -= Cr[r].view(G * K, ds).index_select(0, (i + goff).view(-1)).view(res.shape)
                if resid is not None:
                    resid[s:s + n, g0:g1] = res.transpose(0, 1)
        idx = idx.view(*lead, G, R)
        if return_residual:
            return idx, resid.view(*lead, self.dim)
        return idx

    def lookup(self, idx: torch.Tensor, codebooks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``idx (..., G, R)`` with ``codebooks`` (default: this module's): sum over rounds of the
        selected codewords, groups concatenated -> ``(..., dim)`` in the codebooks' dtype."""
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
        """(G, R) offsets of codebook (g, r) in the flat (G*R*K, ds) view: (g*R + r)*K."""
        G, R, K = self.groups, self.rounds, self.codebook_size
        return (torch.arange(G, device=device)[:, None] * R + torch.arange(R, device=device)) * K

    def code_counts(self, idx: torch.Tensor) -> torch.Tensor:
        """Assignments per code in a batch: ``(G, R, K)`` in the codebooks' dtype (exact integers)."""
        G, R, K = self.groups, self.rounds, self.codebook_size
        i = idx.reshape(-1, G, R).long()
        counts = torch.bincount((i + self._row_offsets(i.device)).reshape(-1), minlength=G * R * K)
        return counts.view(G, R, K).to(self.codebooks.dtype)

    def _targets(self, x: torch.Tensor, idx: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        """Round-r targets: the residuals the search (with codebooks ``cb``) quantised in round r.
        x (N,G,ds) -> (N,G,R,ds)."""
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
        """Nearest codeword per group: x (G,N,ds), C (G,K,ds) -> (G,N) int64, tiled like :meth:`search`."""
        G, K = C.shape[0], C.shape[1]
        c2 = (C * C).sum(-1).unsqueeze(1)
        Ct = C.transpose(1, 2).contiguous()
        rev = torch.arange(K, 0, -1, device=x.device, dtype=x.dtype)
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.int64, device=x.device)
        gs, ts = self._tiles(G, x.shape[1])
        for g0 in range(0, G, gs):
            for s in range(0, x.shape[1], ts):
                d = torch.baddbmm(c2[g0:g0 + gs], x[g0:g0 + gs, s:s + ts], Ct[g0:g0 + gs], alpha=-2.0)
                out[g0:g0 + gs, s:s + ts] = _first_argmin_(d, rev)
        return out

    def _kmeans(self, x: torch.Tensor) -> torch.Tensor:
        """Residual k-means on a batch x (N,G,ds): codebooks (G,R,K,ds), one round after the other."""
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, self.sub_dim
        N = x.shape[0]
        res = x.transpose(0, 1).contiguous()                          # (G, N, ds)
        gi = torch.arange(G, device=x.device)[:, None]
        offs = torch.arange(G, device=x.device)[:, None] * K
        out = torch.empty(G, R, K, ds, dtype=x.dtype, device=x.device)
        for r in range(R):
            sel = (torch.randperm(N, generator=self._gen)[:K] if N >= K
                   else torch.randint(N, (K,), generator=self._gen)).to(x.device)
            C = res[:, sel].clone()
            for _ in range(self.kmeans_iters):
                flat = (self._assign(res, C) + offs).reshape(-1)
                counts = torch.bincount(flat, minlength=G * K).view(G, K, 1)
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
        self.initted.fill_(True)

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
        """Replace codes ``rpos (G,R,M)`` (-1 = unused slot) by ``rval (G,R,M,ds)``; reset their EMA state."""
        g, r, m = (rpos >= 0).nonzero(as_tuple=True)
        if g.numel() == 0:
            return
        k = rpos[g, r, m].long()
        v = rval[g, r, m].to(self.codebooks.dtype)
        self.codebooks[g, r, k] = v
        self.cluster_size[g, r, k] = self.revive_count
        self.embed_sum[g, r, k] = v * self.revive_count

    def _pick_revivals(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dead codes (EMA count < threshold), at most ``max_revive`` per codebook (lowest counts first),
        each paired with the round-r residual of a random token of the batch. Fixed shapes:
        ``(G,R,M)`` int32 positions (-1 = none) and ``(G,R,M,ds)`` values, M = ``max_revive``."""
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, self.sub_dim
        M, dev = self.max_revive, self.codebooks.device
        N = targets.shape[0]
        tok = torch.randint(N, (G, R, max(M, 1)), generator=self._gen).to(dev)[..., :M]
        if M == 0 or self.dead_code_threshold <= 0:
            return (torch.full((G, R, M), -1, dtype=torch.int32, device=dev),
                    torch.zeros(G, R, M, ds, dtype=self.codebooks.dtype, device=dev))
        cs = self.cluster_size
        key = torch.where(cs < self.dead_code_threshold, cs, torch.full_like(cs, math.inf))
        if M >= K:
            pos = torch.arange(K, device=dev).expand(G, R, K)
            ok = torch.isfinite(key)
        else:
            vals, pos = key.topk(M, dim=-1, largest=False, sorted=True)
            ok = torch.isfinite(vals)
        # gather residuals for the dead codes only (usually few of the M slots); the rest stay 0
        g, r, m = ok.nonzero(as_tuple=True)
        rval = torch.zeros(G, R, M, ds, dtype=self.codebooks.dtype, device=dev)
        rval[g, r, m] = targets[tok[g, r, m], g, r].to(self.codebooks.dtype)
        rpos = torch.where(ok, pos, torch.full_like(pos, -1)).to(torch.int32)
        return rpos, rval

    @torch.no_grad()
    def update(self, z: torch.Tensor, idx: torch.Tensor, *, codebooks: torch.Tensor | None = None) -> dict:
        """One learning step from a batch ``z (..., dim)`` and its indices ``idx (..., G, R)`` from
        :meth:`search` with ``codebooks`` (default: this module's current ones; another set, e.g. the
        receiver's copy, makes this k-means with assignments by that set). Returns the op record a
        mirror needs: ``{"op", "stat", "rpos", "rval", "n_tokens"}``.

        * not yet initialised (``kmeans_init``): residual k-means on this batch replaces the codebooks
          (``op=OP_INIT``, ``stat`` = new codebooks); no EMA step on this batch (its indices refer to
          the old codebooks).
        * otherwise (``op=OP_EMA``, ``stat`` = per-code sums of the round targets): EMA of cluster sizes
          and sums, Laplace-smoothed codebooks, then dead-code revival.
        """
        G, R, K, ds = self.groups, self.rounds, self.codebook_size, self.sub_dim
        x = z.detach().reshape(-1, G, ds).to(self.codebooks.dtype)
        i = idx.reshape(-1, G, R).long()
        N = x.shape[0]
        dev = self.codebooks.device
        if not bool(self.initted):
            cb = self._kmeans(x)
            self._apply_init(cb, N)
            self.version += 1
            M = self.max_revive
            return {"op": OP_INIT, "stat": cb, "n_tokens": N,
                    "rpos": torch.full((G, R, M), -1, dtype=torch.int32, device=dev),
                    "rval": torch.zeros(G, R, M, ds, dtype=self.codebooks.dtype, device=dev)}
        targets = self._targets(x, i, self.codebooks if codebooks is None else codebooks)
        flat = (i + self._row_offsets(dev)).reshape(-1)
        sums = torch.zeros(G * R * K, ds, dtype=x.dtype, device=dev).index_add_(0, flat, targets.reshape(-1, ds))
        sums = sums.view(G, R, K, ds)
        counts = torch.bincount(flat, minlength=G * R * K).view(G, R, K).to(self.codebooks.dtype)   # = code_counts(i)
        self._apply_ema(counts, sums)
        rpos, rval = self._pick_revivals(targets)
        self._apply_revivals(rpos, rval)
        self.version += 1
        return {"op": OP_EMA, "stat": sums, "rpos": rpos, "rval": rval, "n_tokens": N, "counts": counts}

    @torch.no_grad()
    def mirror(self, op: int, stat: torch.Tensor, rpos: torch.Tensor, rval: torch.Tensor, idx: torch.Tensor) -> None:
        """Apply a sender's :meth:`update` from its op record and the message's indices: bit-identical
        to what the sender did (same elementwise ops on the same inputs; counts from ``idx``)."""
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
        self.version += 1

    @torch.no_grad()
    def set_codebooks(self, cb: torch.Tensor) -> None:
        """Overwrite the codebooks (e.g. from a checkpoint or a test); keeps counts, bumps the version."""
        self.codebooks.copy_(cb)
        self.embed_sum.copy_(self.codebooks * self.cluster_size.unsqueeze(-1))
        self.initted.fill_(True)
        self.version += 1


class RVQCompressor(Compressor):
    """Projection (``inner``) + residual VQ of z on the wire. Method ``mapl-rvq``.

    In-graph ``encode``/``decode``/``code_dim`` are the inner projection's. On the wire:

    forward payload (``payload_roles("fwd")`` in brackets)::

        [data] codes   uint8 (B, ceil(T*G*R*log2K/8))  indices, bit-packed per sequence (padding only
                                                        to the last byte of each sequence)
        [sync] header  int64 (3,)   [sender codebook version, op, T]
        [sync] ...     mode-specific, fixed shapes independent of (B, T):
            stream   : positions int32 (G,R,n), values (G,R,n,ds)    n codewords per codebook
            full     : values (G,R,K,ds)                              the whole codebook
            mirrored : stat (G,R,K,ds), revive positions int32 (G,R,M), revive values (G,R,M,ds)

    Codebook values travel in the codebooks' dtype (float32), so the receiver copy can become
    bit-identical to the sender's (checksums). backward payload: the r-wide gradient in ``grad_dtype``
    (bf16 by default; not quantised).

    Order of operations. ``pack(z)``: (1) search with the sender codebooks (version v) -> indices;
    (2) if training and not ``dry_run``: EMA update (version v+1); (3) sync slice read from the
    *updated* codebooks. ``unpack(payload)``: (1) unpack indices; (2) decode with the receiver copy;
    (3) apply the sync slice to the receiver copy. So message i is decoded with what messages < i
    delivered: at best version v, exactly the one the search used ("full" and "mirrored" achieve
    this every micro-batch; "stream" lags). Consequence: the very first training micro-batch, whose
    indices come from the pre-k-means codebooks, is decoded with the equally pre-k-means receiver copy.

    Sync modes:

    * ``stream`` (default, the paper's): each micro-batch sends ``n = max(1, round(stream_fraction*K))``
      codewords of every codebook (default fraction 1/K -> n=1). Positions walk a seeded random
      permutation of the K codes per codebook, a new permutation every cycle of ``ceil(K/n)``
      micro-batches, so every codeword is refreshed at least once per cycle: staleness (versions) is
      at most ``2*ceil(K/n) - 2`` while training (one version per micro-batch). Positions are sent, so
      the receiver needs no RNG. Bytes/micro-batch: ``24 + G*R*n*(4 + 4*ds)``. Caveat: the k-means
      init (first training micro-batch) moves every codeword at once, and the receiver holds the
      full initialised codebook only after one cycle (K micro-batches at the default n=1); raise
      ``stream_fraction`` if that warm-up matters.
    * ``full``: the entire codebook every micro-batch (exact, staleness 0; the expensive reference).
      Per micro-batch rather than per optimizer step, because the sender updates per micro-batch and
      the payload must have a fixed shape.
    * ``mirrored``: the receiver repeats the sender's EMA update. Counts come from the indices it
      already has; the per-code sums of the round targets (which need z) are sent, plus up to
      ``max_revive`` (default K/16) revived codes per codebook, and the k-means init result once (in
      the same ``stat`` slot). Bit-identical copies, staleness 0, but the sums are codebook-sized, so
      it costs about as much as ``full``.

    ``search_with``: ``"sender"`` (default, as specified) searches the sender's learned codebooks, so a
    stream-synced receiver decodes some indices with stale codewords: after the k-means init, and
    after every EMA move or dead-code revival, until the codeword is streamed again.
    ``"receiver"`` searches the sender's *shadow* of the receiver copy instead (the sender applies its
    own slice i to the shadow at pack i+1, so the shadow equals what the receiver decodes message
    i+1 with): encoder and decoder codebooks always match and staleness only delays learning, at no
    extra bytes or compute. The EMA then learns the centroids of the shadow's cells (k-means with
    delayed assignments). For ``full`` the two settings are equivalent.

    Staleness (:meth:`staleness`) is the receiver's view: the newest sender version it has heard of
    minus the version of its oldest codeword (mirrored: minus its own version). :meth:`check_sync`
    raises when it exceeds ``max_staleness`` (default ``2*ceil(K/n)`` for stream, 0 otherwise) or a
    mirrored version gap was seen.

    ``sync_payload``/``apply_sync``/``checksum`` are the inner projector's (A is synced after each
    optimizer step by the caller); codebook state travels in the forward payload; codebook
    consistency is checked with :meth:`codebook_checksums` / :meth:`check_sync`.

    Statefulness: codebooks learn only in ``pack`` with ``self.training and not self.dry_run``. With
    ``dry_run`` nothing changes (no learning, no stream cursor move, the receiver ignores the sync
    tensors). In eval the sender's codebooks are frozen but the stream keeps flowing, so a lagging
    receiver copy still converges.
    """

    method = "mapl-rvq"
    SYNC_MODES = ("stream", "full", "mirrored")

    def __init__(self, inner: Compressor, *, groups: int | None = None, rounds: int = 2, codebook_size: int = 256,
                 decay: float = 0.99, sync: str = "stream", stream_fraction: float | None = None,
                 max_staleness: int | None = None, seed: int = 0, grad_dtype: torch.dtype = torch.bfloat16,
                 eps: float = 1e-5, kmeans_init: bool = True, kmeans_iters: int = 10,
                 dead_code_threshold: float = 1.0, max_revive: int | None = None, search_with: str = "receiver",
                 chunk_elems: int = _DEFAULT_CHUNK_ELEMS):
        if not isinstance(inner, Compressor):
            raise TypeError(f"inner must be a Compressor, got {type(inner).__name__}")
        if sync not in self.SYNC_MODES:
            raise ValueError(f"sync={sync!r} is invalid; allowed: {', '.join(map(repr, self.SYNC_MODES))}")
        if search_with not in ("sender", "receiver"):
            raise ValueError(f"search_with={search_with!r} is invalid; allowed: 'sender', 'receiver'")
        if search_with == "receiver" and sync == "mirrored":
            # mirrored EMA keeps the receiver copy equal to the sender's at search time: the same thing
            search_with = "sender"
        super().__init__(inner.d_model)
        self.inner = inner
        self.search_with = search_with
        self.inner.dry_run = self.dry_run
        r = inner.code_dim
        K = codebook_size
        _pow2_bits(K)
        if max_revive is None and sync == "mirrored":
            max_revive = max(1, K // 16)
        kw = dict(dim=r, groups=groups, rounds=rounds, codebook_size=K, decay=decay, eps=eps,
                  kmeans_init=kmeans_init, kmeans_iters=kmeans_iters, dead_code_threshold=dead_code_threshold,
                  seed=seed, max_revive=max_revive, chunk_elems=chunk_elems)
        self.rvq = ResidualVQ(**kw)          # the sender's codebooks (learned)
        self.recv = ResidualVQ(**kw)         # the receiver's copy: same seed -> identical at version 0
        self.sync_mode = sync
        if stream_fraction is None:
            n = 1
        else:
            if not 0.0 < stream_fraction <= 1.0:
                raise ValueError(f"stream_fraction={stream_fraction!r} is invalid; allowed: 0 < f <= 1")
            n = max(1, min(K, round(stream_fraction * K)))
        self.stream_n = n
        self.stream_cycle = -(-K // n)
        if max_staleness is None:
            max_staleness = 2 * self.stream_cycle if sync == "stream" else 0
        self.max_staleness = int(max_staleness)
        self.grad_dtype = grad_dtype
        G, R = self.rvq.groups, self.rvq.rounds
        self._stream_gen = torch.Generator().manual_seed(seed + 7919)
        self.register_buffer("stream_perm", self._new_perm())
        self.register_buffer("stream_cursor", torch.zeros((), dtype=torch.int64))
        self.register_buffer("recv_code_version", torch.zeros(G, R, K, dtype=torch.int64))
        self.register_buffer("recv_seen_version", torch.zeros((), dtype=torch.int64))
        self._desync = False
        self._pending = None     # search_with="receiver": the last slice, applied to the shadow copy at the next pack
        self._stats = {"microbatches": 0, "sync_bytes": 0, "data_bytes": 0, "tokens": 0,
                       "rel_mse": float("nan"), "batch_perplexity": float("nan")}

    # ---- dry_run propagates to the projection ------------------------------------------------
    @property
    def dry_run(self) -> bool:
        return self.__dict__.get("_dry_run", False)

    @dry_run.setter
    def dry_run(self, value: bool) -> None:
        self.__dict__["_dry_run"] = bool(value)
        inner = self.__dict__.get("_modules", {}).get("inner")
        if inner is not None:
            inner.dry_run = bool(value)

    def get_extra_state(self):
        return {"stream_gen": self._stream_gen.get_state(), "stats": dict(self._stats), "desync": self._desync,
                "pending": self._pending}

    def set_extra_state(self, state) -> None:
        self._stream_gen.set_state(state["stream_gen"])
        self._stats = dict(state["stats"])
        self._desync = bool(state["desync"])
        self._pending = state.get("pending")

    # ---- in-graph: the projection ----------------------------------------------------------
    @property
    def code_dim(self) -> int:
        return self.inner.code_dim

    @property
    def recv_codebooks(self) -> torch.Tensor:
        return self.recv.codebooks

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.encode(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.inner.decode(z)

    # ---- wire layout -----------------------------------------------------------------------
    def _sync_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        G, R, K, ds = self.rvq.groups, self.rvq.rounds, self.rvq.codebook_size, self.rvq.sub_dim
        f = self.rvq.codebooks.dtype
        spec = [((3,), torch.int64)]
        if self.sync_mode == "stream":
            n = self.stream_n
            spec += [((G, R, n), torch.int32), ((G, R, n, ds), f)]
        elif self.sync_mode == "full":
            spec += [((G, R, K, ds), f)]
        else:
            M = self.rvq.max_revive
            spec += [((G, R, K, ds), f), ((G, R, M), torch.int32), ((G, R, M, ds), f)]
        return spec

    def payload_spec(self, lead_shape: tuple[int, ...], direction: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
        _check_direction(direction)
        B, T = lead_shape
        if direction == "bwd":
            return [((B, T, self.code_dim), self.grad_dtype)]
        return [((B, packed_nbytes(T * self.rvq.groups * self.rvq.rounds, self.rvq.bits)), torch.uint8)] + self._sync_spec()

    def payload_roles(self, direction: str) -> list[str]:
        _check_direction(direction)
        return ["data"] if direction == "bwd" else ["data"] + ["sync"] * len(self._sync_spec())

    def wire_bytes_per_token(self, direction: str) -> float:
        """fwd: ``G*R*log2(K)/8`` -- exact when ``T*G*R*log2(K)`` is a multiple of 8, otherwise each
        sequence carries < 1 byte of padding; sync bytes are apart (:meth:`sync_bytes_per_microbatch`).
        bwd: ``r * sizeof(grad_dtype)`` (2r for bf16)."""
        _check_direction(direction)
        if direction == "fwd":
            return self.rvq.bits_per_token / 8
        return self.code_dim * torch.tensor([], dtype=self.grad_dtype).element_size()

    def sync_bytes_per_microbatch(self) -> int:
        """Declared codebook-sync bytes piggybacked on every forward message (independent of B, T)."""
        return sum(math.prod(s) * torch.tensor([], dtype=dt).element_size() for s, dt in self._sync_spec())

    # ---- wire: forward -----------------------------------------------------------------------
    def _new_perm(self) -> torch.Tensor:
        G, R, K = self.rvq.groups, self.rvq.rounds, self.rvq.codebook_size
        return torch.rand(G, R, K, generator=self._stream_gen).argsort(dim=-1)

    def _stream_slice(self) -> torch.Tensor:
        """Positions (G,R,n) of this micro-batch's slice; advances the cursor unless dry_run."""
        K, n = self.rvq.codebook_size, self.stream_n
        c = int(self.stream_cursor)
        cols = (c * n + torch.arange(n)) % K
        pos = self.stream_perm[..., cols.to(self.stream_perm.device)]
        if not self.dry_run:
            if c + 1 >= self.stream_cycle:
                self.stream_cursor.zero_()
                self.stream_perm.copy_(self._new_perm())
            else:
                self.stream_cursor += 1
        return pos

    def _sync_tensors(self, op: dict | None) -> list[torch.Tensor]:
        cb = self.rvq.codebooks
        ds = self.rvq.sub_dim
        if self.sync_mode == "stream":
            pos = self._stream_slice()
            val = cb.gather(2, pos.unsqueeze(-1).expand(*pos.shape, ds))
            return [pos.to(torch.int32).contiguous(), val.contiguous()]
        if self.sync_mode == "full":
            return [cb.detach().clone()]
        G, R, K, M = self.rvq.groups, self.rvq.rounds, self.rvq.codebook_size, self.rvq.max_revive
        if op is None:
            return [torch.zeros_like(cb), torch.full((G, R, M), -1, dtype=torch.int32, device=cb.device),
                    torch.zeros(G, R, M, ds, dtype=cb.dtype, device=cb.device)]
        return [op["stat"].to(cb.dtype).contiguous(), op["rpos"].to(torch.int32).contiguous(),
                op["rval"].to(cb.dtype).contiguous()]

    @torch.no_grad()
    def pack(self, z: torch.Tensor) -> list[torch.Tensor]:
        if z.dim() != 3 or z.shape[-1] != self.code_dim:
            raise ValueError(f"pack expects z of shape (B, T, {self.code_dim}), got {tuple(z.shape)}")
        z = z.detach()
        B, T, _ = z.shape
        search_cb = None
        if self.search_with == "receiver":
            if self._pending is not None and not self.dry_run:
                self._apply_sync_slice(*self._pending)   # idempotent if this object's unpack already did
                self._pending = None
            search_cb = self.recv.codebooks              # sender-side shadow of the receiver's copy
        idx, resid = self.rvq.search(z, codebooks=search_cb, return_residual=True)     # (B, T, G, R)
        codes = pack_bits_rows(idx.reshape(B, -1), self.rvq.bits, check=False)   # search output is in range
        op = self.rvq.update(z, idx, codebooks=search_cb) if (self.training and not self.dry_run) else None
        header = torch.tensor([int(self.rvq.version), OP_NONE if op is None else op["op"], T],
                              dtype=torch.int64, device=z.device)
        payload = [codes, header, *self._sync_tensors(op)]
        if self.search_with == "receiver" and not self.dry_run:
            self._pending = (header.clone(), [t.clone() for t in payload[2:]], idx)
        if not self.dry_run:
            st = self._stats
            st["microbatches"] += 1
            st["tokens"] += B * T
            st["data_bytes"] += codes.numel()
            st["sync_bytes"] += sum(t.numel() * t.element_size() for t in payload[1:])
            zf = z.float()
            st["rel_mse"] = float(resid.float().pow(2).sum() / zf.pow(2).sum().clamp_min(1e-30))
            counts = op["counts"] if op is not None and "counts" in op else self.rvq.code_counts(idx)
            p = counts.float() / (B * T)
            st["batch_perplexity"] = float(torch.exp(-(p * p.clamp_min(1e-30).log()).sum(-1)).mean())
        return payload

    @torch.no_grad()
    def unpack(self, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes, header, sync = payload[0], payload[1], payload[2:]
        G, R, bits = self.rvq.groups, self.rvq.rounds, self.rvq.bits
        B, nb = codes.shape
        T = int(header[2])
        if packed_nbytes(T * G * R, bits) != nb:          # header not trusted (e.g. shape inference)
            T = nb * 8 // (G * R * bits)
        idx = unpack_bits_rows(codes, bits, T * G * R).view(B, T, G, R)
        z_q = self.recv.lookup(idx).to(dtype)             # always the receiver's copy
        if not self.dry_run:
            self._apply_sync_slice(header, sync, idx)
        return z_q

    def _apply_sync_slice(self, header: torch.Tensor, sync: list[torch.Tensor], idx: torch.Tensor) -> None:
        v, op = int(header[0]), int(header[1])
        rc = self.recv.codebooks
        if self.sync_mode == "stream":
            pos, val = sync
            p = pos.long().to(rc.device)
            rc.scatter_(2, p.unsqueeze(-1).expand(*p.shape, rc.shape[-1]), val.to(rc))
            self.recv_code_version.scatter_(2, p, v)
        elif self.sync_mode == "full":
            rc.copy_(sync[0])
            self.recv_code_version.fill_(v)
        else:
            stat, rpos, rval = sync
            self.recv.mirror(op, stat.to(rc), rpos.to(rc.device), rval.to(rc), idx)
            if int(self.recv.version) != v:
                self._desync = True
            self.recv_code_version.fill_(int(self.recv.version))
        self.recv_seen_version.fill_(max(v, int(self.recv_seen_version)))

    # ---- wire: backward (the gradient on z, not quantised) -----------------------------------
    def pack_grad(self, g: torch.Tensor) -> list[torch.Tensor]:
        return [g.detach().to(self.grad_dtype).contiguous()]

    def unpack_grad(self, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return payload[0].to(dtype)

    # ---- shared state --------------------------------------------------------------------------
    def sync_payload(self) -> dict[str, torch.Tensor]:
        return self.inner.sync_payload()

    def apply_sync(self, payload: dict[str, torch.Tensor]) -> None:
        self.inner.apply_sync(payload)

    def sync_bytes_per_step(self) -> int:
        return self.inner.sync_bytes_per_step()

    def receiver_grad_bytes_per_step(self) -> int:
        return self.inner.receiver_grad_bytes_per_step()

    def fold_receiver_grad(self) -> None:
        self.inner.fold_receiver_grad()

    def basis(self) -> torch.Tensor | None:
        return self.inner.basis()

    @property
    def learned(self) -> bool:
        return self.inner.learned

    def checksum(self) -> int:
        return self.inner.checksum()

    def codebook_checksums(self) -> tuple[int, int]:
        """(CRC32 of the sender's codebooks, CRC32 of the receiver's copy): equal iff bit-identical."""
        return tensor_checksum(self.rvq.codebooks), tensor_checksum(self.recv.codebooks)

    def staleness(self) -> int:
        """Versions the receiver copy is behind the newest sender version it has heard of."""
        if self.sync_mode == "mirrored":
            return int(self.recv_seen_version) - int(self.recv.version)
        return int(self.recv_seen_version) - int(self.recv_code_version.min())

    def check_sync(self, *, raise_on_error: bool = True) -> dict:
        """Staleness vs ``max_staleness`` and (mirrored) version gaps; raises RuntimeError on either
        unless ``raise_on_error=False``. ``identical`` compares the two copies held by this object
        (meaningful where one object plays both sides, as in the single-process pipeline)."""
        s = self.staleness()
        crc_s, crc_r = self.codebook_checksums()
        rep = {"staleness": s, "max_staleness": self.max_staleness, "desync": self._desync,
               "sender_crc": crc_s, "receiver_crc": crc_r, "identical": crc_s == crc_r}
        rep["ok"] = s <= self.max_staleness and not self._desync
        if raise_on_error and not rep["ok"]:
            why = "mirrored version gap" if self._desync else f"staleness {s} > max_staleness {self.max_staleness}"
            raise RuntimeError(f"RVQ codebook sync ({self.sync_mode}): {why}")
        return rep

    def diagnostics(self) -> dict:
        cs = self.rvq.cluster_size.float()
        p = cs / cs.sum(-1, keepdim=True).clamp_min(1e-30)
        ppl = torch.exp(-(p * p.clamp_min(1e-30).log()).sum(-1))            # (G, R)
        thr = self.rvq.dead_code_threshold if self.rvq.dead_code_threshold > 0 else 1e-3
        dead = (cs < thr).float().mean(-1) * 100.0                          # (G, R)
        st = self._stats
        crc_s, crc_r = self.codebook_checksums()
        return {
            **self.inner.diagnostics(),
            "rvq_groups": self.rvq.groups, "rvq_rounds": self.rvq.rounds, "rvq_codebook_size": self.rvq.codebook_size,
            "rvq_sync": self.sync_mode,
            "codebook_perplexity_mean": float(ppl.mean()), "codebook_perplexity_min": float(ppl.min()),
            "codebook_perplexity_per_round": ppl.mean(0).tolist(),
            "dead_code_pct": float(dead.mean()), "dead_code_pct_max": float(dead.max()),
            "dead_code_pct_per_round": dead.mean(0).tolist(),
            "batch_perplexity_mean": st["batch_perplexity"], "rel_mse": st["rel_mse"],
            "codebook_version": int(self.rvq.version), "staleness": self.staleness(),
            "max_staleness": self.max_staleness, "codebooks_identical": crc_s == crc_r,
            "sync_bytes_total": st["sync_bytes"], "data_bytes_total": st["data_bytes"],
            "microbatches": st["microbatches"],
        }
