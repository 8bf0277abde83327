"""Greedy residual nearest-codeword search: the bulk of an RVQ message's cost.

Round r of the search quantises, per group, the residual left by rounds < r with codebook r: the
nearest of K codewords, i.e. the argmin over k of ``||c_k||^2 - 2 x.c_k`` (``||x||^2`` is the same for
every codeword; ties: the first minimum, as ``argmin``). Python loops run over tiles and rounds only;
within a tile all its groups and tokens are one batched operation.

Two kernels find the nearest codeword (``compressor.rvq.search_kernel``):

* ``matmul``: distances by one batched matmul per tile and round ([res, 1] @ [-2c; ||c||^2]), then an
  argmin. Exact and cache-friendly on a CPU when a tile's (groups, tokens, K) distance block is
  cache-sized (``search_tile_bytes``, default 4 MiB there). On a GPU every distance is written to and
  read back from memory: 8 bytes per distance, ~17 GB per 32k-token message at r = 256, K = 256, which
  bounds it (large tiles, default 256 MiB, keep it from being launch-bound as well).
* ``fused``: the same argmin compiled (torch.compile) into one kernel that never stores the distances.
  Only the token dimension of the compiled kernel is symbolic: with a symbolic codeword dimension the
  sum over it is a reduction of unknown length, inductor cannot inline it into the argmin and writes
  the whole (G, N, K) fp32 distance block (measured on CPU at G = 128, N = 4,096, K = 256: +516 MiB
  peak per call, against +4 MiB with static codeword, group and codebook dimensions; same indices).
  Its transient memory is O(G·N) (:func:`search_transient_bytes`), one compile per (G, K, ds, dtype,
  device) and per "one token or more", warmed before training (:func:`warm_fused_search`).
* ``auto`` (default): matmul on a CPU (the cpu profile's numbers), fused on a GPU.

Under a (non-infrastructure) ``TorchDispatchMode`` -- a host-read counter, a FLOP counter, a memory probe
-- the search runs the matmul kernel whatever the setting: dynamo does not compile a frame under such a
mode, the ``fullgraph`` kernel then raises, and the failed frame stays failed for every later call in the
process (:func:`fused_allowed`).

Both are exact searches; they can differ only on exact distance ties computed with different rounding.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ...config import RVQ_SEARCH_KERNELS

__all__ = ["SEARCH_KERNELS", "CPU_TILE_BYTES", "GPU_TILE_BYTES", "residual_search", "search_tiles", "tile_budget",
           "first_argmin_", "uses_fused", "fused_allowed", "search_transient_bytes", "warm_fused_search"]

SEARCH_KERNELS = RVQ_SEARCH_KERNELS
CPU_TILE_BYTES = 4 << 20          # the "auto" tile budget (bytes of one tile's distance block) on a CPU
GPU_TILE_BYTES = 256 << 20        # ... and on a GPU


def first_argmin_(d: torch.Tensor, rev: torch.Tensor) -> torch.Tensor:
    """``d.argmin(-1)`` (the first minimum on ties), overwriting ``d``; ``rev = arange(K, 0, -1)`` in d's dtype.

    ATen's CPU argmin is a scalar loop (~0.8 ns per value); this is four vectorised passes (~0.25 ns per
    value on a cache-sized block): m = min over the row; d <- (d <= m) * (K - k), i.e. K - k exactly at
    the minima and 0 elsewhere (an in-place float comparison, no bool tensor); the first minimum has the
    largest K - k. Exact: the comparison is against the row's own minimum, and K <= 2**16 is exact in
    float32. A row holding NaN yields an index in range (not necessarily argmin's). On a GPU, where
    argmin is one parallel pass (also the first minimum), that is used instead.
    """
    if d.is_cuda:
        return d.argmin(-1)
    K = d.shape[-1]
    m = d.amin(-1, keepdim=True)
    d.le_(m).mul_(rev)
    return (K - d.amax(-1).to(torch.int64)).clamp_(0, K - 1)


def _nearest_fused(res: torch.Tensor, C: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """argmin_k ||c_k||^2 - 2 res.c_k for res (g, n, ds), codebooks C (g, K, ds), c2 = ||C||^2 (g, K) ->
    (g, n) int64 (the first minimum on ties). Written as an elementwise product, a sum over the few
    codeword dims and an argmin so that torch.compile fuses it into one kernel: the (g, n, K) distances
    stay in registers instead of making two trips through memory, which is what bounds the matmul
    search on a GPU (see SEARCH_KERNELS). Only ever run compiled (eagerly it would build (g, n, K, ds))."""
    dot = (res.unsqueeze(2) * C.unsqueeze(1)).sum(-1)
    return (c2.unsqueeze(1) - 2.0 * dot).argmin(-1)


_COMPILED: dict[str, object] = {}


def _fused_kernel():
    """The compiled :func:`_nearest_fused` (compiled on first use; see :func:`_tokens_symbolic`).
    ``dynamic=False``: every dimension is static unless marked, so the codeword dimension ds stays a
    constant and the sum over it is unrolled into the argmin's loop (dynamic=True made it symbolic
    and inductor then materialised the (G, N, K) distances)."""
    if "nearest" not in _COMPILED:
        _COMPILED["nearest"] = torch.compile(_nearest_fused, dynamic=False, fullgraph=True)
    return _COMPILED["nearest"]


def _tokens_symbolic(res: torch.Tensor) -> torch.Tensor:
    """Mark the token dimension of ``res`` (g, n, ds) dynamic, so that micro-batches, evaluation batches
    and k-means samples of any size share one compiled kernel (n = 1 gets its own: dynamo specialises
    sizes 0 and 1)."""
    torch._dynamo.maybe_mark_dynamic(res, 1)
    return res


def search_tiles(n_groups: int, n_tokens: int, K: int, budget_elems: int) -> tuple[int, int]:
    """(groups, tokens) per search tile so a tile's (groups, tokens, K) distance block holds about
    ``budget_elems`` values. All groups at once while that leaves >= 16 tokens per tile (few, large
    batched matmuls); for large K, fewer groups per tile rather than fewer tokens."""
    ts = budget_elems // (n_groups * K)
    if ts >= min(16, n_tokens):
        return n_groups, max(1, ts)
    gs = max(1, min(n_groups, budget_elems // (16 * K)))
    return gs, max(1, budget_elems // (gs * K))


def tile_budget(tile_bytes: int, dtype: torch.dtype, device: torch.device) -> int:
    """Distance values per tile: ``tile_bytes`` (0 = the device's default) over the value size."""
    budget = tile_bytes or (GPU_TILE_BYTES if device.type == "cuda" else CPU_TILE_BYTES)
    return max(1, budget // dtype.itemsize)


def uses_fused(kernel: str, device: torch.device | str) -> bool:
    """Whether ``kernel`` ('auto' | 'matmul' | 'fused') runs the compiled kernel on ``device``."""
    return kernel == "fused" or (kernel == "auto" and torch.device(device).type == "cuda")


def fused_allowed() -> bool:
    """Whether the compiled kernel may run now: not under a non-infrastructure dispatch mode, where dynamo
    skips the frame and ``fullgraph=True`` turns the skip into an error that poisons the frame for the
    rest of the process (torch 2.11-2.13)."""
    return not is_in_torch_dispatch_mode(include_infra_modes=False)


def search_transient_bytes(n_tokens: int, groups: int, rounds: int, K: int, ds: int, *, kernel: str = "auto",
                           tile_bytes: int = 0, device: torch.device | str = "cpu", itemsize: int = 4) -> int:
    """Peak bytes :func:`residual_search` allocates for one call with ``return_residual`` (as a pack does)
    on ``n_tokens`` tokens, beyond its input: the per-round codebooks, the augmented residual
    (G, N, ds+1), indices (N, G, R) int64 twice (the tile's and the output), the residual out, and per
    round the nearest indices and their row offsets (G, N) int64 and the gathered codewords (G, N, ds).
    The matmul kernel adds its tile's distance block (at most the tile budget) and two (g, n) row
    reductions; the fused one nothing beyond O(G·N) (its distances never leave the kernel)."""
    G, N, R = groups, n_tokens, rounds
    fixed = R * G * K * ds * itemsize + G * N * (ds + 1) * itemsize + 2 * N * G * R * 8 + N * G * ds * itemsize
    per_round = 2 * G * N * 8 + G * N * ds * itemsize
    if uses_fused(kernel, device):
        return fixed + per_round
    budget = tile_budget(tile_bytes, torch.float32 if itemsize == 4 else torch.float64, torch.device(device))
    gs, ts = search_tiles(G, N, K, budget)
    gs, ts = min(gs, G), min(ts, N)
    block = gs * ts * K * itemsize + 2 * gs * ts * itemsize
    return fixed + R * G * (ds + 1) * K * itemsize + per_round + block


@torch.no_grad()                         # as ResidualVQ.search: grad mode is part of the compiled guard
def warm_fused_search(groups: int, K: int, ds: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Compile the fused kernel for this shape now (tens of seconds cold), not inside the first step,
    where a neighbour stage would wait on us under the run's communication timeout."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, groups, ds, generator=g).to(device=device, dtype=dtype)
    C = torch.randn(groups, 1, K, ds, generator=g).to(device=device, dtype=dtype)
    residual_search(x, C, kernel="fused")


def residual_search(x: torch.Tensor, C: torch.Tensor, *, kernel: str = "auto", tile_bytes: int = 0,
                    return_residual: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, G, ds) and codebooks C (G, R, K, ds), one dtype -> indices (N, G, R) int64 and, with
    ``return_residual``, the final residual (N, G, ds) (else None). Token-major outputs, contiguous."""
    N, G, ds = x.shape
    R, K, dev, dt = C.shape[1], C.shape[2], x.device, x.dtype
    xt = x.transpose(0, 1)                                              # (G, N, ds) view
    Cr = [C[:, r].contiguous() for r in range(R)]                       # (G, K, ds) per round
    fused = uses_fused(kernel, dev) and fused_allowed()       # under a dispatch mode: matmul (module docstring)
    nearest = _nearest(Cr, fused)
    idx = torch.empty(N, G, R, dtype=torch.int64, device=dev)
    resid = torch.empty(N, G, ds, dtype=dt, device=dev) if return_residual else None
    # fused: no distance block to bound, one tile
    gs, ts = (G, max(1, N)) if fused else search_tiles(G, N, K, tile_budget(tile_bytes, dt, dev))
    for g0 in range(0, G, gs):
        g1 = min(G, g0 + gs)
        goff = torch.arange(g0, g1, device=dev)[:, None] * K            # row offsets into (G*K, ds)
        for s in range(0, N, ts):
            n = min(ts, N - s)
            res_aug = torch.ones(g1 - g0, n, ds + 1, dtype=dt, device=dev)
            res_aug[..., :ds] = xt[g0:g1, s:s + n]
            idx[s:s + n, g0:g1] = _search_tile(res_aug, nearest, Cr, goff, g0, g1)
            if resid is not None:
                resid[s:s + n, g0:g1] = res_aug[..., :ds].transpose(0, 1)
    return idx, resid


def _nearest(Cr: list[torch.Tensor], fused: bool):
    """``f(res_aug, r, g0, g1) -> (g1-g0, n)``: the nearest codeword of round r for a tile of groups
    g0:g1 whose residuals are ``res_aug[..., :-1]`` (``res_aug = [res, 1]``)."""
    c2 = [(c * c).sum(-1) for c in Cr]                                  # ||c||^2 (G, K) per round
    if fused:
        kernel = _fused_kernel()
        return lambda res_aug, r, g0, g1: kernel(_tokens_symbolic(res_aug[..., :-1]), Cr[r][g0:g1], c2[r][g0:g1])
    # augmented codebooks [-2 c ; ||c||^2] (G, ds+1, K): with res_aug = [res, 1] one bmm gives
    # ||c||^2 - 2 res.c directly (no broadcast copy of ||c||^2 into the output, as baddbmm does)
    Ca = [torch.cat([-2.0 * c.transpose(1, 2), q.unsqueeze(1)], 1).contiguous() for c, q in zip(Cr, c2)]
    K, dev, dt = Cr[0].shape[1], Cr[0].device, Cr[0].dtype
    rev = torch.arange(K, 0, -1, device=dev, dtype=dt)                 # K - k
    return lambda res_aug, r, g0, g1: first_argmin_(torch.bmm(res_aug, Ca[r][g0:g1]), rev)


def _search_tile(res_aug: torch.Tensor, nearest, Cr: list[torch.Tensor], goff: torch.Tensor, g0: int,
                 g1: int) -> torch.Tensor:
    """All rounds of one (groups g0:g1, tokens) tile: ``res_aug = [res, 1]`` (gs, n, ds+1) in, its
    residual part updated in place; returns the indices (n, gs, R). ``nearest`` finds round r's
    codewords; ``Cr`` are the full per-round codebooks (G, K, ds), indexed through ``goff`` (the tile's
    row offsets into the flat (G*K, ds) table)."""
    res = res_aug[..., :-1]                                             # (gs, n, ds) view
    G, K, ds = Cr[0].shape
    out = torch.empty(res.shape[1], res.shape[0], len(Cr), dtype=torch.int64, device=res.device)
    for r, cr in enumerate(Cr):
        i = nearest(res_aug, r, g0, g1)                                 # (gs, n)
        out[:, :, r] = i.T
        res -= cr.view(G * K, ds).index_select(0, (i + goff).view(-1)).view(res.shape)
    return out
